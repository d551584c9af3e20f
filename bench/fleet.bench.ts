// Fleet latencies (issue 22): 20 concurrent creates (a size the pool is not booted in, and a shape it cannot hold),
// DELETE latency beside the full cleanup it no longer waits for, and the create + exec + delete cycle beside bare
// `runc run` (podman is not installed on these hosts; `runc run` without --detach creates, runs and deletes).

import { spawn } from "node:child_process";
import { execFileSync } from "node:child_process";
import { mkdir, mkdtemp, rm, writeFile, readFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { api, bareRun } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const BURST = 20;
const CYCLES = Number(process.env.KILN_BENCH_CYCLES ?? 20);

/** `n` bare `runc run /bin/true` on `layer` at once: each one's time from its start to its exit. */
async function bareRunConcurrent(layer: string, n: number): Promise<number[]> {
  const dir = await mkdtemp(join(tmpdir(), "kiln-bench-fleet-"));
  try {
    execFileSync("runc", ["spec", "--bundle", dir]);
    const spec = JSON.parse(await readFile(join(dir, "config.json"), "utf8"));
    spec.root = { path: layer, readonly: true };
    spec.process.args = ["/bin/true"];
    spec.process.terminal = false;
    await writeFile(join(dir, "config.json"), JSON.stringify(spec));
    await mkdir(join(dir, "state"), { recursive: true });
    return await Promise.all(
      Array.from({ length: n }, (_, i) => {
        const t0 = performance.now();
        return new Promise<number>((resolve, reject) =>
          spawn("runc", ["--root", join(dir, "state"), "run", "--bundle", dir, `kiln-bench-fleet-${process.pid}-${i}`], { stdio: "ignore" }).on("exit", (code) =>
            code === 0 ? resolve(performance.now() - t0) : reject(new Error(`runc run exited ${code}`)),
          ),
        );
      }),
    );
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const results: BenchResult[] = [];
  const json = (method: string, path: string, body?: unknown) => api(ctx.kiln.url, ctx.key, method, path, body);
  const { pool, machines, driver } = ctx.kiln.kiln.services;
  const base = await ctx.kiln.kiln.services.templates.resolve("local/base");
  const layer = base.layers[base.layers.length - 1];
  const waitPool = async () => {
    for (let w = 0; w < 1000 && pool.stats().ready < pool.stats().size; w++) await new Promise((r) => setTimeout(r, 10));
  };
  const settle = () => machines.cleanupsSettled(120_000);

  // 20 creates at once, each timed to its first exec answered.
  const burst = async (body: Record<string, unknown>) => {
    await waitPool();
    await settle();
    const ids: string[] = [];
    const times = await Promise.all(
      Array.from({ length: BURST }, async () => {
        const t0 = performance.now();
        const m = await json("POST", "/v1/machines", body);
        ids.push(m.id);
        await json("POST", `/v1/machines/${m.id}/exec`, { cmd: "true", args: [] });
        return performance.now() - t0;
      }),
    );
    await Promise.all(ids.map((id) => json("DELETE", `/v1/machines/${id}`)));
    await settle();
    return times;
  };
  await settle();
  const bareBurst = await bareRunConcurrent(layer, BURST);
  const bareBaseline = { name: `${BURST} bare \`runc run /bin/true\` at once, same rootfs`, median: median(bareBurst), p99: percentile(bareBurst, 99) };
  const sized = await burst({ template: "local/base", vcpus: 2, memory_mb: 512 });
  results.push({
    name: `${BURST} concurrent creates → first exec, a size the pool is not booted in (vcpus 2, 512 MiB)`,
    unit: "ms",
    better: "lower",
    median: median(sized),
    p99: percentile(sized, 99),
    baseline: bareBaseline,
    goal: "p50 ≤ 150 ms, p99 ≤ 400 ms",
    note: `pool of ${pool.stats().size} (runc: any size from the pool, resized at handout); the rest boot cold`,
  });
  const unpooled = await burst({ template: "local/base", internet: false });
  results.push({
    name: `${BURST} concurrent creates → first exec, a shape the pool cannot hold (internet off)`,
    unit: "ms",
    better: "lower",
    median: median(unpooled),
    p99: percentile(unpooled, 99),
    baseline: bareBaseline,
    goal: "p50 ≤ 150 ms, p99 ≤ 400 ms",
    note: "every one a cold boot",
  });

  // DELETE answered, beside the full removal it used to wait for (the driver's destroy of the same kind of machine).
  const deleteTimes: number[] = [];
  const destroyTimes: number[] = [];
  for (let i = 0; i < CYCLES; i++) {
    await waitPool();
    const a = await json("POST", "/v1/machines", { template: "local/base" });
    const b = await json("POST", "/v1/machines", { template: "local/base" });
    let t0 = performance.now();
    await json("DELETE", `/v1/machines/${a.id}`);
    deleteTimes.push(performance.now() - t0);
    await settle();
    // The old path: agent closed, then every part removed before answering (the record is left to the store).
    await machines.withMachine(b.id, async () => {
      t0 = performance.now();
      await driver.destroy(b.id);
      destroyTimes.push(performance.now() - t0);
    });
    await json("DELETE", `/v1/machines/${b.id}`);
    await settle();
  }
  results.push({
    name: "DELETE of a running machine, answered",
    unit: "ms",
    better: "lower",
    median: median(deleteTimes),
    p99: percentile(deleteTimes, 99),
    baseline: { name: "the full removal (driver destroy: runtime delete, network, cgroups, mounts, disk) it no longer waits for", median: median(destroyTimes), p99: percentile(destroyTimes, 99) },
    goal: "≤ 10 ms",
    note: "processes killed through the cgroup and the record written; the rest runs behind the answer",
  });

  // create + exec + delete, one after another; the pool refills between cycles as on a host that is not saturated.
  const cycleTimes: number[] = [];
  for (let i = 0; i < CYCLES; i++) {
    await waitPool();
    const t0 = performance.now();
    const m = await json("POST", "/v1/machines", { template: "local/base" });
    await json("POST", `/v1/machines/${m.id}/exec`, { cmd: "true", args: [] });
    await json("DELETE", `/v1/machines/${m.id}`);
    cycleTimes.push(performance.now() - t0);
    await settle();
  }
  const bareCycle = await bareRun("runc", layer, CYCLES);
  results.push({
    name: "create + exec `true` + delete cycle (warm pool)",
    unit: "ms",
    better: "lower",
    median: median(cycleTimes),
    p99: percentile(cycleTimes, 99),
    baseline: { name: "bare `runc run /bin/true` (create, start, wait, delete; podman is not installed here)", median: median(bareCycle), p99: percentile(bareCycle, 99) },
    goal: "≤ 0.5 × podman run --rm",
  });
  return results;
}
