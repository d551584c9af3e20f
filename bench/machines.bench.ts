// Machine latencies a user feels: create → first exec answered (beside a bare `runc run /bin/true` on the same
// rootfs), the exec round trip of `true` (beside a plain HTTP round trip to the same server), and idle machines' memory.

import { execFileSync, spawn } from "node:child_process";
import { api, bareRun } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const CREATES = Number(process.env.KILN_BENCH_CREATES ?? 50);
const EXECS = 300;
const IDLE = Number(process.env.KILN_BENCH_IDLE ?? 50);

const json = (ctx: BenchContext, method: string, path: string, body?: unknown) => api(ctx.kiln.url, ctx.key, method, path, body);

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const results: BenchResult[] = [];
  const base = await ctx.kiln.kiln.services.templates.resolve("local/base");

  // create → first exec answered: from the warm pool (the default shape, pool given time to refill between
  // creates, as on a host that is not saturated) and cold (another shape, so a boot happens in the request).
  const timeCreate = async (body: Record<string, unknown>) => {
    const t0 = performance.now();
    const m = await json(ctx, "POST", "/v1/machines", body);
    await json(ctx, "POST", `/v1/machines/${m.id}/exec`, { cmd: "true", args: [] });
    const took = performance.now() - t0;
    ids.push(m.id);
    if (ids.length > 10) await json(ctx, "DELETE", `/v1/machines/${ids.shift()}`);
    return took;
  };
  const ids: string[] = [];
  const pool = ctx.kiln.kiln.services.pool;
  const warmTimes: number[] = [];
  for (let i = 0; i < CREATES; i++) {
    for (let w = 0; w < 400 && pool.stats().ready < pool.stats().size; w++) await new Promise((r) => setTimeout(r, 10));
    warmTimes.push(await timeCreate({ template: "local/base" }));
  }
  const coldTimes: number[] = [];
  for (let i = 0; i < Math.min(CREATES, 30); i++) coldTimes.push(await timeCreate({ template: "local/base", internet: false }));
  const runcTimes = await bareRun("runc", base.layers[base.layers.length - 1], Math.min(CREATES, 30));
  const runcBaseline = { name: "bare `runc run /bin/true`, same rootfs", median: median(runcTimes), p99: percentile(runcTimes, 99) };
  results.push({
    name: `machine create → first exec answered, warm pool (${CREATES} machines)`,
    unit: "ms",
    better: "lower",
    median: median(warmTimes),
    p99: percentile(warmTimes, 99),
    baseline: runcBaseline,
    goal: "p50 ≤ 50 ms",
    note: `pool of ${pool.stats().size}, refilled between creates`,
  });
  results.push({
    name: `machine create → first exec answered, cold boot (${coldTimes.length} machines)`,
    unit: "ms",
    better: "lower",
    median: median(coldTimes),
    p99: percentile(coldTimes, 99),
    baseline: runcBaseline,
    note: "a shape the pool cannot hold (internet: false; any vcpus/memory now come from it): runc + guest agent start in the request",
  });

  // exec round trip of `true`
  const id = ids[ids.length - 1];
  for (let i = 0; i < 20; i++) await json(ctx, "POST", `/v1/machines/${id}/exec`, { cmd: "true", args: [] });
  const execTimes: number[] = [];
  for (let i = 0; i < EXECS; i++) {
    const t0 = performance.now();
    await json(ctx, "POST", `/v1/machines/${id}/exec`, { cmd: "true", args: [] });
    execTimes.push(performance.now() - t0);
  }
  // Floor: the same process start done by a Node process on the host, with no machine, HTTP or agent in between.
  const spawnTimes: number[] = [];
  for (let i = 0; i < EXECS; i++) {
    const t0 = performance.now();
    await new Promise((resolve) => spawn("/bin/true", [], { stdio: ["ignore", "pipe", "pipe"] }).on("close", resolve));
    spawnTimes.push(performance.now() - t0);
  }
  results.push({
    name: "exec round trip of `true` on a running machine",
    unit: "ms",
    better: "lower",
    median: median(execTimes),
    p99: percentile(execTimes, 99),
    baseline: { name: "host Node `child_process.spawn('/bin/true')`", median: median(spawnTimes), p99: percentile(spawnTimes, 99) },
    goal: "p50 ≤ 5 ms",
    note: "includes HTTP + auth + store lookup, the agent hop, switching to the machine user and a process group",
  });
  for (const left of ids) await json(ctx, "DELETE", `/v1/machines/${left}`);

  // idle machines: memory each costs
  const memAvailable = () => Number(/MemAvailable:\s+(\d+)/.exec(execFileSync("cat", ["/proc/meminfo"], { encoding: "utf8" }))![1]) * 1024;
  // The base pool grows with a run of creates (KILN_WARM_POOL_MAX): its idle machines are counted with the held ones.
  const pooled = async () => {
    for (let w = 0; w < 500 && pool.stats().booting > 0; w++) await new Promise((r) => setTimeout(r, 20));
    return pool.stats().ready;
  };
  const pooledBefore = await pooled();
  const before = memAvailable();
  const idle: string[] = [];
  for (let i = 0; i < IDLE; i++) idle.push((await json(ctx, "POST", "/v1/machines", { template: "local/base" })).id);
  const pooledAfter = await pooled();
  await new Promise((r) => setTimeout(r, 2000));
  const held = IDLE + pooledAfter - pooledBefore;
  const perMachine = (before - memAvailable()) / held / 2 ** 20;
  for (const m of idle) await json(ctx, "DELETE", `/v1/machines/${m}`);
  const hostGiB = Number(/MemTotal:\s+(\d+)/.exec(execFileSync("cat", ["/proc/meminfo"], { encoding: "utf8" }))![1]) / 2 ** 20;
  results.push({
    name: `memory per idle machine (${IDLE} held)`,
    unit: "MiB",
    better: "lower",
    median: perMachine,
    goal: "≥ 2,000 idle machines on 24 GiB (≤ 10 MiB each)",
    note: `host MemAvailable before/after over ${held} machines (${IDLE} created, ${pooledAfter - pooledBefore} more in the pool): agent, tini, slirp4netns, kernel; ≈ ${Math.floor((hostGiB * 1024 * 0.9) / perMachine)} idle machines fit in 90% of this host's ${hostGiB.toFixed(0)} GiB`,
  });
  return results;
}
