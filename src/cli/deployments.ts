// `kiln deployments create|ls|get|update|url|services|logs|restart|rm`: agent deployments and their service instances
// for people, over HTTP. Public URLs carry an edge token: they are printed only when asked for (--urls).

import type { Command } from "commander";
import { apiClient, listAll } from "./client.ts";
import type { ApiClient } from "./client.ts";

const collect = (v: string, prev: string[] = []) => [...prev, v];

function parseEnvs(list: string[] | undefined): Record<string, string> | undefined {
  if (!list || list.length === 0) return undefined;
  return Object.fromEntries(
    list.map((kv) => {
      const i = kv.indexOf("=");
      return i < 0 ? [kv, process.env[kv] ?? ""] : [kv.slice(0, i), kv.slice(i + 1)];
    }),
  );
}

interface ServiceRecord {
  id: string;
  status: string;
  version_id: string;
  machine_id: string;
  process_id: number | null;
  public_url: string | null;
  failure_reason: string | null;
}

function readinessOf(opts: { readinessPath?: string; readinessInterval?: number; readinessTimeout?: number }) {
  if (opts.readinessPath === undefined && opts.readinessInterval === undefined && opts.readinessTimeout === undefined) return undefined;
  return { path: opts.readinessPath, interval_s: opts.readinessInterval, timeout_s: opts.readinessTimeout };
}

const ACCESS_HELP = "public URL access: token (default; a long-lived token, rotatable), public (no credential: anyone with the URL), signed (expiring, fresh per read)";

interface DeploymentUrl {
  edge_url: string | null;
  public_url: boolean;
  access: string;
}

export function deploymentCommands(program: Command) {
  const deployments = program.command("deployments").alias("d").description("Serve agents: deployments of supervised services with public URLs");

  deployments
    .command("create")
    .description("Create a deployment and print its id; its replicas start in machines of the template")
    .requiredOption("--name <name>")
    .requiredOption("-c, --command <shell line>", "the service's command, run as the machine's user")
    .requiredOption("-p, --port <port>", "the port the service listens on", (v) => Number(v))
    .option("-t, --template <ref>", "template ref or artifact id", "local/base")
    .option("-e, --env <KEY=VALUE>", "deployment env (repeatable; KEY alone takes it from your environment)", collect)
    .option("-r, --replicas <n>", "number of replicas", (v) => Number(v))
    .option("--no-public-url", "never give services a public URL")
    .option("--access <mode>", ACCESS_HELP)
    .option("--readiness-path <path>", "HTTP path probed for readiness (default: a TCP probe)")
    .option("--readiness-interval <seconds>", "seconds between probes", (v) => Number(v))
    .option("--readiness-timeout <seconds>", "seconds a probe may take", (v) => Number(v))
    .option("--json", "print the whole record")
    .action(async (opts) => {
      const d = await apiClient().call<{ id: string }>("POST", "/v1/agent-deployments", {
        name: opts.name,
        template: opts.template,
        command: opts.command,
        port: opts.port,
        envs: parseEnvs(opts.env),
        replicas: opts.replicas,
        public_url: opts.publicUrl,
        access: opts.access,
        readiness: readinessOf(opts),
      });
      process.stdout.write(opts.json ? JSON.stringify(d, null, 2) + "\n" : d.id + "\n");
    });

  deployments
    .command("update <id>")
    .description("Roll a new version onto the replicas, one at a time")
    .option("-c, --command <shell line>")
    .option("-p, --port <port>", "", (v) => Number(v))
    .option("-t, --template <ref>")
    .option("-e, --env <KEY=VALUE>", "replaces the deployment's envs (repeatable)", collect)
    .option("-r, --replicas <n>", "", (v) => Number(v))
    .option("--access <mode>", `${ACCESS_HELP}; alone, it changes the URLs without rolling the replicas`)
    .option("--readiness-path <path>")
    .option("--readiness-interval <seconds>", "", (v) => Number(v))
    .option("--readiness-timeout <seconds>", "", (v) => Number(v))
    .action(async (id: string, opts) => {
      const d = await apiClient().call<{ id: string; version: number; access: string }>("PATCH", `/v1/agent-deployments/${id}`, {
        command: opts.command,
        port: opts.port,
        template: opts.template,
        envs: parseEnvs(opts.env),
        replicas: opts.replicas,
        access: opts.access,
        readiness: readinessOf(opts),
      });
      const rolls = ["command", "port", "template", "env", "replicas", "readinessPath", "readinessInterval", "readinessTimeout"].some((k) => opts[k] !== undefined);
      process.stdout.write(rolls ? `${d.id} rolling to version ${d.version}\n` : `${d.id} access ${d.access}\n`);
    });

  deployments
    .command("url <id>")
    .description("Print the deployment's own public URL (the same on every read; it outlives rollouts). It is a credential: keep it out of shared logs")
    .option("--rotate", "replace its token first: every URL with the old one stops at once")
    .action(async (id: string, opts: { rotate?: boolean }) => {
      const client = apiClient();
      const d = opts.rotate
        ? await client.call<DeploymentUrl>("POST", `/v1/agent-deployments/${id}/rotate-edge-token`)
        : await client.call<DeploymentUrl>("GET", `/v1/agent-deployments/${id}`);
      if (d.edge_url) return void process.stdout.write(d.edge_url + "\n");
      const why = !d.public_url ? "it gives no public URL (public_url false)" : "its access is signed: each service's URL is signed and expires (deployments services --urls)";
      process.stderr.write(`kiln: deployment ${id} has no stable URL: ${why}\n`);
      process.exitCode = 1;
    });

  deployments
    .command("ls")
    .alias("list")
    .description("List deployments")
    .action(async () => {
      const client = apiClient();
      type DeploymentLine = { id: string; name: string; status: string; version: number; replicas: number; rollout_status: string };
      for await (const d of listAll<DeploymentLine>(client, "/v1/agent-deployments", "deployments")) {
        process.stdout.write(`${d.id}\t${d.name}\tv${d.version}\t${d.replicas} replica(s)\t${d.status}\trollout ${d.rollout_status}\n`);
      }
    });

  deployments
    .command("get <id>")
    .description("Print a deployment's record with its versions")
    .action(async (id: string) => {
      process.stdout.write(JSON.stringify(await apiClient().call("GET", `/v1/agent-deployments/${id}`), null, 2) + "\n");
    });

  deployments
    .command("services <id>")
    .description("List a deployment's service instances")
    .option("--urls", "also print public URLs (they carry a credential: keep them out of shared logs)")
    .option("--json", "print the whole records")
    .action(async (id: string, opts: { urls?: boolean; json?: boolean }) => {
      const { services } = await apiClient().call<{ services: ServiceRecord[] }>("GET", `/v1/agent-deployments/${id}/services`);
      if (opts.json) return void process.stdout.write(JSON.stringify(services, null, 2) + "\n");
      for (const s of services) {
        const cols = [s.id, s.status, s.version_id, s.machine_id, `pid ${s.process_id ?? "-"}`];
        if (s.failure_reason) cols.push(s.failure_reason);
        if (opts.urls && s.public_url) cols.push(s.public_url);
        process.stdout.write(cols.join("\t") + "\n");
      }
    });

  deployments
    .command("logs <id> <service_id>")
    .description("Print a service's recent output; -f keeps printing what it writes next")
    .option("--tail <bytes>", "at most this many bytes", (v) => Number(v))
    .option("-f, --follow", "keep printing new output (every 0.5 s) until Ctrl-C")
    .action(async (id: string, serviceId: string, opts: { tail?: number; follow?: boolean }) => {
      const client = apiClient();
      const path = `/v1/agent-deployments/${id}/services/${serviceId}/logs`;
      const q = opts.tail === undefined ? "" : `?tail_bytes=${opts.tail}`;
      const first = await client.call<ServiceLogs>("GET", path + q);
      process.stdout.write(first.output);
      if (opts.follow) await followLogs(client, path, first.total_bytes);
    });

  deployments
    .command("restart <id> <service_id>")
    .description("Restart a service; --env values reach the new process only and are stored nowhere")
    .option("--reason <text>")
    .option("-e, --env <KEY=VALUE>", "request-only env (repeatable; KEY alone takes it from your environment, keeping it out of shell history)", collect)
    .option("--idempotency-key <key>", "a repeated restart with the same key answers the first result")
    .action(async (id: string, serviceId: string, opts: { reason?: string; env?: string[]; idempotencyKey?: string }) => {
      const s = await apiClient().call<ServiceRecord>(
        "POST",
        `/v1/agent-deployments/${id}/services/${serviceId}/restart`,
        { reason: opts.reason, envs: parseEnvs(opts.env) },
        opts.idempotencyKey ? { "idempotency-key": opts.idempotencyKey } : {},
      );
      process.stdout.write(`${s.id} ${s.status} pid ${s.process_id ?? "-"}\n`);
    });

  deployments
    .command("rm <ids...>")
    .description("Delete deployments: every service stops and its machine is destroyed")
    .action(async (ids: string[]) => {
      const client = apiClient();
      for (const id of ids) {
        await client.call("DELETE", `/v1/agent-deployments/${id}`);
        process.stdout.write(`${id} deleted\n`);
      }
    });
}

interface ServiceLogs {
  output: string;
  total_bytes: number;
  truncated: boolean;
}

/** The service keeps its last 256 KiB and a running byte count: what it wrote since `seen` is the tail past it. */
const LOG_RING_BYTES = 262144;
const FOLLOW_INTERVAL_MS = 500;

async function followLogs(client: ApiClient, path: string, seen: number): Promise<never> {
  for (;;) {
    await new Promise((r) => setTimeout(r, FOLLOW_INTERVAL_MS));
    const head = await client.call<ServiceLogs>("GET", `${path}?tail_bytes=0`);
    if (head.total_bytes === seen) continue;
    const now = await client.call<ServiceLogs>("GET", `${path}?tail_bytes=${LOG_RING_BYTES}`);
    const bytes = Buffer.from(now.output, "utf8");
    if (now.total_bytes < seen) {
      // A new process (a restart or a new machine) starts its count again: all it wrote is new.
      process.stdout.write(bytes);
    } else {
      const fresh = now.total_bytes - seen;
      if (fresh > bytes.length) process.stderr.write(`kiln: [${fresh - bytes.length} bytes of output went by unseen]\n`);
      process.stdout.write(bytes.subarray(Math.max(0, bytes.length - fresh)));
    }
    seen = now.total_bytes;
  }
}
