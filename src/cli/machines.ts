// `kiln machines create|ls|get|rm|exec|hibernate|resume`: the machine API for people, over HTTP.

import type { Command } from "commander";
import { apiClient, fail, listAll } from "./client.ts";
import { openShell } from "./shell.ts";
import { streamExec } from "./exec-stream.ts";
import { copy } from "./copy.ts";
import type { MachineView } from "../machines/service.ts";

function parseKv(list: string[] | undefined): Record<string, string> | undefined {
  if (!list || list.length === 0) return undefined;
  return Object.fromEntries(
    list.map((kv) => {
      const i = kv.indexOf("=");
      return i < 0 ? [kv, ""] : [kv.slice(0, i), kv.slice(i + 1)];
    }),
  );
}

const collect = (v: string, prev: string[] = []) => [...prev, v];

/** `vol_…:/data` or `vol_…:/data:ro` (room: volumes). */
function parseVolumes(list: string[] | undefined) {
  if (!list || list.length === 0) return undefined;
  return list.map((spec) => {
    const [volume_id, path, mode, ...rest] = spec.split(":");
    if (!volume_id || !path || rest.length > 0 || (mode !== undefined && mode !== "ro" && mode !== "rw")) fail(`--volume takes vol_id:/path[:ro], got ${JSON.stringify(spec)}`);
    return { volume_id, path, ...(mode === "ro" ? { read_only: true } : {}) };
  });
}

export function machineCommands(program: Command) {
  const machines = program.command("machines").alias("m").description("Create and use machines (talks to a running server)");

  machines
    .command("create")
    .description("Create a machine and print its id")
    .option("-t, --template <ref>", "template ref or artifact id", "local/base")
    .option("--name <name>")
    .option("--timeout <seconds>", "destroy after this many seconds", (v) => Number(v))
    .option("-e, --env <KEY=VALUE>", "environment variable (repeatable)", collect)
    .option("--no-internet", "no outbound network")
    .option("-v, --volume <vol_id:/path[:ro]>", "mount a volume (repeatable)", collect)
    .option("--vcpus <n>", "vCPUs", (v) => Number(v))
    .option("--memory <mb>", "memory in MiB", (v) => Number(v))
    .option("--disk <mb>", "size of the machine's writable disk in MiB", (v) => Number(v))
    .option("--json", "print the whole record")
    .action(async (opts: { template: string; name?: string; timeout?: number; env?: string[]; internet: boolean; volume?: string[]; vcpus?: number; memory?: number; disk?: number; json?: boolean }) => {
      const m = await apiClient().call<MachineView>("POST", "/v1/machines", {
        template: opts.template,
        name: opts.name,
        timeout_s: opts.timeout,
        vcpus: opts.vcpus,
        memory_mb: opts.memory,
        disk_mb: opts.disk,
        envs: parseKv(opts.env),
        internet: opts.internet,
        volumes: parseVolumes(opts.volume),
      });
      process.stdout.write(opts.json ? JSON.stringify(m, null, 2) + "\n" : m.id + "\n");
    });

  machines
    .command("ls")
    .alias("list")
    .description("List machines")
    .option("--all", "include destroyed machines")
    .action(async (opts: { all?: boolean }) => {
      const client = apiClient();
      const statuses = opts.all ? [undefined, "destroyed", "failed"] : [undefined];
      for (const status of statuses) {
        for await (const m of listAll<MachineView>(client, "/v1/machines", "machines", status ? { status } : {})) {
          process.stdout.write(`${m.id}\t${m.status}\t${m.name ?? "-"}\t${m.created_at}\texpires ${m.expires_at}\n`);
        }
      }
    });

  machines
    .command("get <id>")
    .description("Print a machine's record")
    .action(async (id: string) => {
      process.stdout.write(JSON.stringify(await apiClient().call("GET", `/v1/machines/${id}`), null, 2) + "\n");
    });

  machines
    .command("rm <ids...>")
    .description("Destroy machines")
    .action(async (ids: string[]) => {
      const client = apiClient();
      for (const id of ids) {
        await client.call("DELETE", `/v1/machines/${id}`);
        process.stdout.write(`${id} destroyed\n`);
      }
    });

  for (const op of ["hibernate", "resume"] as const) {
    machines
      .command(`${op} <id>`)
      .description(op === "hibernate" ? "Freeze a machine's processes" : "Resume a hibernated machine")
      .action(async (id: string) => {
        const m = await apiClient().call<MachineView>("POST", `/v1/machines/${id}/${op}`);
        process.stdout.write(`${m.id} ${m.status}\n`);
      });
  }

  machines
    .command("cp <src> <dst>")
    .description("Copy a file between a machine and here, as docker cp: one side is <machine id>:<path>, the other a local path or - (stdin/stdout)")
    .action(async (src: string, dst: string) => {
      await copy(apiClient(), src, dst);
    });

  machines
    .command("shell <id>")
    .description("Open an interactive terminal in a machine (reconnects after a dropped connection); with piped stdin, run the commands it carries")
    .option("-u, --user <user>")
    .option("-c, --cmd <cmd>", "program to run instead of the user's login shell")
    .action(async (id: string, opts: { user?: string; cmd?: string }) => {
      process.exitCode = await openShell(apiClient(), id, opts);
    });

  machines
    .command("exec <id> <cmd...>")
    .description("Run a command (one word: a shell line; several: program and arguments), streaming its output as it comes")
    .option("-u, --user <user>")
    .option("-w, --cwd <dir>")
    .option("-e, --env <KEY=VALUE>", "environment variable (repeatable)", collect)
    .option("-i, --interactive", "send this terminal's stdin to the command (as docker exec -i)")
    .option("--timeout <seconds>", "kill the command after this many seconds, keeping its output so far (exit status 124)", (v) => Number(v))
    .action(async (id: string, cmd: string[], opts: { user?: string; cwd?: string; env?: string[]; interactive?: boolean; timeout?: number }) => {
      if (opts.timeout !== undefined && !(opts.timeout > 0)) fail("--timeout takes a number of seconds above 0");
      process.exitCode = await streamExec(
        apiClient(),
        id,
        { cmd: cmd[0]!, ...(cmd.length > 1 ? { args: cmd.slice(1) } : {}), user: opts.user, cwd: opts.cwd, envs: parseKv(opts.env) },
        { timeoutS: opts.timeout, stdin: opts.interactive },
      );
    });
}
