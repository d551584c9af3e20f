// Many hosts, measured in one run on one real PostgreSQL:
// - an exec forwarded through a server that does not run the machine, beside the same exec sent straight to the
//   server that runs it (two servers in this process, so the forwarding hop's CPU shares the event loop with the
//   owner's: a cluster on separate hosts pays the network instead);
// - a request to a deployment's public URL (the edge) through a server whose replica another host runs (the cluster
//   port tunnel), beside the same request to the server that runs it;
// - 40 concurrent creates through one server placed across three hosts, beside the same 40 through the same server
//   with the other two hosts drained (one host alone). All three servers share this machine's two cores, so the spread
//   buys only what one host's own serialisation (its boot queue, its store writes) costs, not more CPU;
// - the time from a host's death (SIGKILL of its server process) to its machines marked failed, beside the bound
//   it is configured with (KILN_HOST_LOST_AFTER_S).

import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import type { TestKiln } from "../test/support/kiln.ts";
import { withCluster } from "./cluster.ts";
import { startServerProcess } from "../test/webhooks/server-process.ts";
import { appCommand } from "../test/deployments/support.ts";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";

const EXECS = 200;
const CREATES = 40;
const ROUNDS = 2;
const LOST_AFTER_S = 5;
const HEARTBEAT_MS = 500;

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const env = { KILN_HOST_LOST_AFTER_S: String(LOST_AFTER_S), KILN_HOST_HEARTBEAT_MS: String(HEARTBEAT_MS) };
  return withCluster(2, env, async ([front, owner], cluster) => {
    const results: BenchResult[] = [await forwardedExec(ctx, front, owner)];
    progress(results);
    results.push(await edgeThroughPeer(ctx, front, owner));
    progress(results);

    const third = await cluster.start();
    results.push(await spreadCreates(ctx, front, [owner, third]));
    progress(results);
    results.push(await deathToFailed(ctx, front, cluster.dbUrl));
    return results;
  });
}

/** Each result as soon as it is measured (the run prints them all only at its end). */
function progress(results: BenchResult[]) {
  const r = results.at(-1)!;
  process.stderr.write(`  (so far) ${r.name}: ${r.median.toFixed(2)} ${r.unit}${r.baseline ? ` (baseline ${r.baseline.median.toFixed(2)})` : ""}${r.note ? `; ${r.note}` : ""}\n`);
}

/** Polls `check` every 50 ms until it holds; a real bound, so a stuck step fails the bench with its name. */
async function until(what: string, check: () => Promise<boolean>, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`hosts bench: timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

async function forwardedExec(ctx: BenchContext, front: TestKiln, owner: TestKiln): Promise<BenchResult> {
  // Made on the owner itself (no placement), so the machine is known to run there.
  const machine = await owner.kiln.services.machines.create({});
  const exec = (url: string) => api(url, ctx.key, "POST", `/v1/machines/${machine.id}/exec`, { cmd: "true", args: [] });
  for (let i = 0; i < 20; i++) {
    await exec(owner.url);
    await exec(front.url);
  }
  const direct: number[] = [];
  const forwarded: number[] = [];
  for (let i = 0; i < EXECS; i++) {
    let t0 = performance.now();
    await exec(owner.url);
    direct.push(performance.now() - t0);
    t0 = performance.now();
    await exec(front.url);
    forwarded.push(performance.now() - t0);
  }
  await owner.kiln.services.machines.destroy(machine.id);
  return {
    name: "exec forwarded through another host's server",
    unit: "ms",
    better: "lower",
    median: median(forwarded),
    p99: percentile(forwarded, 99),
    baseline: { name: "the same exec sent to the owning server", median: median(direct), p99: percentile(direct, 99) },
    goal: "≤ 1.5 × direct, or + ≤ 1 ms",
  };
}

async function edgeThroughPeer(ctx: BenchContext, front: TestKiln, owner: TestKiln): Promise<BenchResult> {
  // Made through the owner, whose server makes the replica itself; public access, so no token rides along.
  const dep = (await api(owner.url, ctx.key, "POST", "/v1/agent-deployments", { template: "local/base", name: "bench-edge", command: appCommand(8080), port: 8080, access: "public" })) as { id: string };
  let svcId = "";
  await until("the replica to be ready", async () => {
    const list = (await api(owner.url, ctx.key, "GET", `/v1/agent-deployments/${dep.id}/services`)) as { services: { id: string; status: string }[] };
    svcId = list.services.find((s) => s.status === "ready")?.id ?? "";
    return svcId !== "";
  }, 120_000);
  const get = async (url: string) => {
    const res = await fetch(`${url}/edge/${svcId}/hello`);
    await res.arrayBuffer();
    return res.status;
  };
  // The front learns of the owner's replica from the store within about a second.
  await until("the front's edge to know the replica", async () => (await get(front.url)) === 200, 30_000);
  for (let i = 0; i < 20; i++) {
    await get(owner.url);
    await get(front.url);
  }
  const direct: number[] = [];
  const through: number[] = [];
  for (let i = 0; i < EXECS; i++) {
    let t0 = performance.now();
    if ((await get(owner.url)) !== 200) throw new Error("the edge on the owner did not answer 200");
    direct.push(performance.now() - t0);
    t0 = performance.now();
    if ((await get(front.url)) !== 200) throw new Error("the edge through the peer did not answer 200");
    through.push(performance.now() - t0);
  }
  await api(owner.url, ctx.key, "DELETE", `/v1/agent-deployments/${dep.id}`);
  return {
    name: "edge request (GET, small answer) through a server whose replica another host runs",
    unit: "ms",
    better: "lower",
    median: median(through),
    p99: percentile(through, 99),
    baseline: { name: "the same request to the server that runs the replica", median: median(direct), p99: percentile(direct, 99) },
    note: "kept-alive tunnels: the proxy's pool reuses each, as it does the local agent's",
  };
}

/** Creates per second: `CREATES` at once through `front` (a 503 — floors refusing for now — is tried again). */
async function burst(ctx: BenchContext, front: TestKiln): Promise<{ rate: number; hosts: number }> {
  const t0 = performance.now();
  const made = await Promise.all(
    Array.from({ length: CREATES }, async () => {
      for (;;) {
        const res = await fetch(`${front.url}/v1/machines`, { method: "POST", headers: { authorization: `Bearer ${ctx.key}`, "content-type": "application/json" }, body: "{}" });
        const body = (await res.json()) as { id: string; host_id: string };
        if (res.status === 201) return body;
        if (res.status !== 503) throw new Error(`create answered ${res.status}: ${JSON.stringify(body)}`);
        await new Promise((r) => setTimeout(r, 100));
      }
    }),
  );
  const rate = CREATES / ((performance.now() - t0) / 1000);
  const hosts = new Set(made.map((m) => m.host_id)).size;
  await Promise.all(made.map((m) => api(front.url, ctx.key, "DELETE", `/v1/machines/${m.id}`)));
  // Teardown is asynchronous: wait until every host has finished it, so the next burst starts on clean hosts.
  await until("the burst's machines to be gone", async () => ((await api(front.url, ctx.key, "GET", "/v1/machines?limit=100")) as { machines: unknown[] }).machines.length === 0, 120_000);
  await new Promise((r) => setTimeout(r, 2000));
  return { rate, hosts };
}

async function spreadCreates(ctx: BenchContext, front: TestKiln, others: TestKiln[]): Promise<BenchResult> {
  const hostIdOf = async (s: TestKiln) => ((await api(s.url, ctx.key, "GET", "/v1/hosts")) as { hosts: { id: string; self: boolean }[] }).hosts.find((h) => h.self)!.id;
  const otherIds = await Promise.all(others.map(hostIdOf));
  const alone: number[] = [];
  const spread: number[] = [];
  let spreadHosts = 0;
  for (let i = 0; i < ROUNDS; i++) {
    for (const id of otherIds) await api(front.url, ctx.key, "POST", `/v1/hosts/${id}/drain`);
    const one = await burst(ctx, front);
    if (one.hosts !== 1) throw new Error(`with two hosts drained the creates landed on ${one.hosts} hosts`);
    alone.push(one.rate);
    for (const id of otherIds) await api(front.url, ctx.key, "POST", `/v1/hosts/${id}/activate`);
    const three = await burst(ctx, front);
    spreadHosts = Math.max(spreadHosts, three.hosts);
    spread.push(three.rate);
  }
  return {
    name: `${CREATES} concurrent creates through one server, placed across three hosts`,
    unit: "creates/s",
    better: "higher",
    median: median(spread),
    baseline: { name: "the same creates with the other two hosts drained (one host alone)", median: median(alone) },
    goal: "≥ 2 × one host alone",
    note: `landed on ${spreadHosts} hosts; all three servers share this machine's cores`,
  };
}

async function deathToFailed(ctx: BenchContext, front: TestKiln, dbUrl: string): Promise<BenchResult> {
  const dir = await mkdtemp(join(tmpdir(), "kiln-bench-victim-"));
  // At info: startServerProcess waits for the "kiln is serving" line.
  const victim = await startServerProcess(dir, { KILN_DATABASE_URL: dbUrl, KILN_HOST_ID: "h-victim", KILN_LOG_LEVEL: "info", KILN_HOST_LOST_AFTER_S: String(LOST_AFTER_S), KILN_HOST_HEARTBEAT_MS: String(HEARTBEAT_MS) });
  try {
    // Every other host drained for the moment, so the victim's creates stay on it.
    const hosts = ((await api(front.url, ctx.key, "GET", "/v1/hosts")) as { hosts: { id: string; status: string }[] }).hosts.filter((h) => h.id !== "h-victim" && h.status === "active");
    for (const h of hosts) await api(front.url, ctx.key, "POST", `/v1/hosts/${h.id}/drain`);
    const ids: string[] = [];
    for (let i = 0; i < 3; i++) {
      for (let tries = 0; ; tries++) {
        process.stderr.write(`  (victim create ${i} try ${tries})\n`);
        const res = await victim.call("POST", "/v1/machines", {});
        if (res.status === 201) {
          ids.push(res.body.id);
          break;
        }
        if (res.status !== 503 || tries > 300) throw new Error(`victim create answered ${res.status}`);
        await new Promise((r) => setTimeout(r, 100));
      }
    }
    for (const h of hosts) await api(front.url, ctx.key, "POST", `/v1/hosts/${h.id}/activate`);
    const killedAt = performance.now();
    victim.child.kill("SIGKILL");
    await victim.exited;
    await until("the dead host's machines to be failed", async () => (await Promise.all(ids.map((id) => api(front.url, ctx.key, "GET", `/v1/machines/${id}`) as Promise<{ status: string }>))).every((m) => m.status === "failed"), 120_000);
    const ms = performance.now() - killedAt;
    return {
      name: "a host's death (SIGKILL) to its machines marked failed",
      unit: "ms",
      better: "lower",
      median: ms,
      baseline: { name: "the configured bound, KILN_HOST_LOST_AFTER_S", median: LOST_AFTER_S * 1000 },
      goal: "≤ KILN_HOST_LOST_AFTER_S + one heartbeat",
      note: `${ids.length} machines; heartbeat every ${HEARTBEAT_MS} ms; one death per run`,
    };
  } finally {
    // The victim starts again on its data dir: adoption removes its failed machines' containers, then it stops.
    const again = await startServerProcess(dir, { KILN_DATABASE_URL: dbUrl, KILN_HOST_ID: "h-victim", KILN_LOG_LEVEL: "info" }).catch(() => undefined);
    await again?.stop();
    await victim.stop().catch(() => undefined);
    await rm(dir, { recursive: true, force: true });
  }
}
