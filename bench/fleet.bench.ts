// Fleet latencies (issue 22): 100 creates → first exec → delete at concurrency 10 (sustained creates/s beside bare
// `runc run` at the same concurrency), 20 concurrent creates (a size the pool is not booted in, and a shape it cannot
// hold), DELETE latency beside the full cleanup it no longer waits for, and the create + exec + delete cycle and the
// exec round trip beside podman (`podman run --rm` and `podman exec` of the same rootfs imported as an image; bare
// `runc run` where podman is not installed). Every row runs on the server's default config: the base pool of 2
// grows with the create rate (KILN_WARM_POOL_MAX=auto), so the notes say what it held.

import { spawn } from "node:child_process";
import { execFileSync } from "node:child_process";
import { subscribe, unsubscribe } from "node:diagnostics_channel";
import { mkdir, mkdtemp, rm, writeFile, readFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { api, bareRun } from "./api.ts";
import { median, percentile, timed } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const BURST = 20;
const CYCLES = Number(process.env.KILN_BENCH_CYCLES ?? 20);
const FLEET = 100;
const FLEET_CONCURRENCY = 10;
const EXECS = 100;
/** podman's default ulimits exceed this host's (HOST-NOTES.md); these are what it accepts. */
const PODMAN_LIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096"];

/** Runs `fn(i)` for i < n, `concurrency` at a time (each worker takes the next index). */
async function inParallel<T>(n: number, concurrency: number, fn: (i: number) => Promise<T>): Promise<T[]> {
  const out: T[] = new Array(n);
  let next = 0;
  await Promise.all(
    Array.from({ length: concurrency }, async () => {
      while (next < n) {
        const i = next++;
        out[i] = await fn(i);
      }
    }),
  );
  return out;
}

function command(cmd: string, args: string[]): Promise<void> {
  return new Promise((resolve, reject) =>
    spawn(cmd, args, { stdio: "ignore" })
      .on("error", reject)
      .on("exit", (code) => (code === 0 ? resolve() : reject(new Error(`${cmd} ${args.slice(0, 2).join(" ")} exited ${code}`)))),
  );
}

function hasPodman(): boolean {
  try {
    execFileSync("podman", ["--version"], { stdio: "ignore" });
    return true;
  } catch {
    return false;
  }
}

/** The base template's rootfs imported into podman as an image (a tar of it piped into `podman import`). */
async function podmanImport(layer: string, image: string): Promise<void> {
  await new Promise<void>((resolve, reject) => {
    const tar = spawn("tar", ["-C", layer, "--numeric-owner", "-cf", "-", "."], { stdio: ["ignore", "pipe", "ignore"] });
    const imp = spawn("podman", ["import", "-", image], { stdio: [tar.stdout, "ignore", "inherit"] });
    let failed = false;
    tar.on("exit", (code) => {
      if (code !== 0 && !failed) (failed = true), reject(new Error(`tar of the base rootfs exited ${code}`));
    });
    imp.on("error", reject).on("exit", (code) => {
      if (failed) return;
      if (code === 0) resolve();
      else reject(new Error(`podman import exited ${code}`));
    });
  });
}

/** CPU time (ms) the machine's cgroup has used so far (its processes: the guest agent, what it ran), or NaN. */
async function machineCpuMs(id: string): Promise<number> {
  const v1 = await readFile(`/sys/fs/cgroup/cpuacct/kiln/${id}/cpuacct.usage`, "utf8").catch(() => undefined);
  if (v1 !== undefined) return Number(v1) / 1e6;
  const v2 = await readFile(`/sys/fs/cgroup/kiln/${id}/cpu.stat`, "utf8").catch(() => "");
  return Number(/^usage_usec (\d+)/m.exec(v2)?.[1] ?? NaN) / 1000;
}

/** CPU time (ms) of this process's children that have been waited for (/proc/self/stat cutime + cstime). */
async function childrenCpuMs(): Promise<number> {
  const stat = await readFile("/proc/self/stat", "utf8");
  const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  // After the comm field: cutime and cstime are fields 16 and 17 of stat(5), here at 13 and 14, in clock ticks (100/s).
  return (Number(f[13]) + Number(f[14])) * 10;
}

/**
 * CPU time (ms) of this process's live children and what they waited for: the server's host-command helper (runc,
 * mount, nft, … it runs for the server) and its reaped commands.
 */
async function liveChildrenCpuMs(): Promise<number> {
  const { readdir } = await import("node:fs/promises");
  let ms = 0;
  for (const pid of await readdir("/proc")) {
    if (!/^\d+$/.test(pid)) continue;
    const stat = await readFile(`/proc/${pid}/stat`, "utf8").catch(() => "");
    const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    // ppid is field 4 of stat(5) (1 here); utime, stime, cutime, cstime fields 14–17 (11–14 here).
    if (Number(f[1]) !== process.pid) continue;
    ms += (Number(f[11]) + Number(f[12]) + Number(f[13]) + Number(f[14])) * 10;
  }
  return ms;
}

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
  const { pool } = ctx.kiln.kiln.services;
  const base = await ctx.kiln.kiln.services.templates.resolve("local/base");
  const layer = base.layers[base.layers.length - 1];
  const podman = hasPodman();
  const image = `localhost/kiln-bench-base-${process.pid}`;
  const container = `kiln-bench-exec-${process.pid}`;
  if (podman) {
    process.stderr.write("  importing the base rootfs into podman …\n");
    await podmanImport(layer, image);
  }
  try {
    await fleet(ctx, results);
    await bursts(ctx, results);
    await cycles(ctx, results, podman ? image : undefined);
    await execs(ctx, results, podman ? { image, container } : undefined);
  } finally {
    if (podman) {
      await command("podman", ["rm", "-f", "-t", "0", container]).catch(() => undefined);
      await command("podman", ["rmi", "-f", image]).catch(() => undefined);
    }
  }
  process.stderr.write(`  pool after: ${JSON.stringify({ ...pool.stats(), ids: undefined })}\n`);
  return results;
}

/** Takes of the base pool (hit or miss) while `fn` runs, from the metrics' diagnostics channel. */
async function countingTakes<T>(fn: () => Promise<T>): Promise<{ value: T; hits: number; misses: number }> {
  let hits = 0;
  let misses = 0;
  const onTake = (m: unknown) => ((m as { hit: boolean }).hit ? hits++ : misses++);
  subscribe("kiln.metrics.warm_pool_take", onTake);
  try {
    return { value: await fn(), hits, misses };
  } finally {
    unsubscribe("kiln.metrics.warm_pool_take", onTake);
  }
}

/** 100 creates → first exec → delete, 10 at a time: the creates a second it sustains, beside bare `runc run`. */
async function fleet(ctx: BenchContext, results: BenchResult[]) {
  const json = (method: string, path: string, body?: unknown) => api(ctx.kiln.url, ctx.key, method, path, body);
  const { pool, machines } = ctx.kiln.kiln.services;
  const base = await ctx.kiln.kiln.services.templates.resolve("local/base");
  const layer = base.layers[base.layers.length - 1];
  await machines.cleanupsSettled(120_000);
  for (let w = 0; w < 1000 && pool.stats().ready < pool.stats().size; w++) await new Promise((r) => setTimeout(r, 10));
  const before = pool.stats();
  let grewTo = before.size;
  const watch = setInterval(() => (grewTo = Math.max(grewTo, pool.stats().size)), 50);
  const machineCpu: number[] = [];
  const cpu0 = process.cpuUsage();
  const helper0 = await liveChildrenCpuMs();
  const t0 = performance.now();
  const { value: each, hits } = await countingTakes(() =>
    inParallel(FLEET, FLEET_CONCURRENCY, async () => {
      const t = performance.now();
      const m = await json("POST", "/v1/machines", { template: "local/base" });
      await json("POST", `/v1/machines/${m.id}/exec`, { cmd: "true", args: [] });
      const firstExec = performance.now() - t;
      machineCpu.push(await machineCpuMs(m.id));
      await json("DELETE", `/v1/machines/${m.id}`);
      return firstExec;
    }),
  );
  const kilnS = (performance.now() - t0) / 1000;
  const serverCpu = process.cpuUsage(cpu0);
  const helperCpu = ((await liveChildrenCpuMs()) - helper0) / FLEET;
  clearInterval(watch);
  await machines.cleanupsSettled(120_000);
  const dir = await mkdtemp(join(tmpdir(), "kiln-bench-fleet10-"));
  let bareS: number;
  let bareCpu: number;
  try {
    execFileSync("runc", ["spec", "--bundle", dir]);
    const spec = JSON.parse(await readFile(join(dir, "config.json"), "utf8"));
    spec.root = { path: layer, readonly: true };
    spec.process.args = ["/bin/true"];
    spec.process.terminal = false;
    await writeFile(join(dir, "config.json"), JSON.stringify(spec));
    await mkdir(join(dir, "state"), { recursive: true });
    const c0 = await childrenCpuMs();
    const b0 = performance.now();
    await inParallel(FLEET, FLEET_CONCURRENCY, (i) => command("runc", ["--root", join(dir, "state"), "run", "--bundle", dir, `kiln-bench-fleet10-${process.pid}-${i}`]));
    bareS = (performance.now() - b0) / 1000;
    bareCpu = ((await childrenCpuMs()) - c0) / FLEET;
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
  results.push({
    name: `${FLEET} creates → first exec → delete at concurrency ${FLEET_CONCURRENCY}, sustained`,
    unit: "creates/s",
    better: "higher",
    median: FLEET / kilnS,
    baseline: { name: `${FLEET} bare \`runc run /bin/true\` at concurrency ${FLEET_CONCURRENCY}, same rootfs`, median: FLEET / bareS },
    goal: "≥ 0.8 × bare runc",
    note: `default config: the pool of ${before.size} (${before.ready} ready) grew with demand to ${grewTo} (auto bound ${before.max}); ${hits} of ${FLEET} taken from it; create → first exec p50 ${median(each).toFixed(0)} ms, p99 ${percentile(each, 99).toFixed(0)} ms; CPU per create: ${median(machineCpu).toFixed(0)} ms in the machine (agent start, exec; p50), ${((serverCpu.user + serverCpu.system) / 1000 / FLEET).toFixed(0)} ms in the server's process (with this bench's client), ${helperCpu.toFixed(0)} ms by the host-command helper and the commands it reaped; bare runc ${bareCpu.toFixed(0)} ms per run`,
  });
}

async function bursts(ctx: BenchContext, results: BenchResult[]) {
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
    held = pool.stats();
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
  let held = pool.stats();
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
    note: `pool of ${held.size} at the burst's start (${held.ready} ready; default config, grown by the rows before; runc: any size from the pool, resized at handout); the rest boot cold`,
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

}

/** create + exec + delete one after another, beside `podman run --rm` of the same rootfs (bare `runc run` without podman). */
async function cycles(ctx: BenchContext, results: BenchResult[], image: string | undefined) {
  const json = (method: string, path: string, body?: unknown) => api(ctx.kiln.url, ctx.key, method, path, body);
  const { pool, machines } = ctx.kiln.kiln.services;
  const base = await ctx.kiln.kiln.services.templates.resolve("local/base");
  const layer = base.layers[base.layers.length - 1];
  // The pool refills between cycles as on a host that is not saturated.
  const cycleTimes: number[] = [];
  for (let i = 0; i < CYCLES; i++) {
    for (let w = 0; w < 1000 && pool.stats().ready < pool.stats().size; w++) await new Promise((r) => setTimeout(r, 10));
    const t0 = performance.now();
    const m = await json("POST", "/v1/machines", { template: "local/base" });
    await json("POST", `/v1/machines/${m.id}/exec`, { cmd: "true", args: [] });
    await json("DELETE", `/v1/machines/${m.id}`);
    cycleTimes.push(performance.now() - t0);
    await machines.cleanupsSettled(120_000);
  }
  const baseline = image
    ? { name: "`podman run --rm` of the same rootfs (imported as an image) running `true`", times: await timed(CYCLES, () => command("podman", ["run", "--rm", ...PODMAN_LIMITS, image, "true"])) }
    : { name: "bare `runc run /bin/true` (create, start, wait, delete; podman is not installed on this host)", times: await bareRun("runc", layer, CYCLES) };
  results.push({
    name: "create + exec `true` + delete cycle (warm pool)",
    unit: "ms",
    better: "lower",
    median: median(cycleTimes),
    p99: percentile(cycleTimes, 99),
    baseline: { name: baseline.name, median: median(baseline.times), p99: percentile(baseline.times, 99) },
    goal: "≤ 0.5 × podman run --rm (ratio ≥ 2)",
    note: image ? "podman 4.3 with its default network (bridge), as root" : "podman not on PATH: bare runc stands in (it does less than podman)",
  });
}

/** Exec of `true` on a running machine, beside `podman exec` into a running container of the same rootfs. */
async function execs(ctx: BenchContext, results: BenchResult[], podman: { image: string; container: string } | undefined) {
  const json = (method: string, path: string, body?: unknown) => api(ctx.kiln.url, ctx.key, method, path, body);
  const m = await json("POST", "/v1/machines", { template: "local/base" });
  let kiln: number[];
  try {
    await json("POST", `/v1/machines/${m.id}/exec`, { cmd: "true", args: [] });
    kiln = await timed(EXECS, () => json("POST", `/v1/machines/${m.id}/exec`, { cmd: "true", args: [] }));
  } finally {
    await json("DELETE", `/v1/machines/${m.id}`);
  }
  let baseline: { name: string; times: number[] };
  if (podman) {
    await command("podman", ["run", "-d", "--name", podman.container, ...PODMAN_LIMITS, podman.image, "sleep", "infinity"]);
    await command("podman", ["exec", podman.container, "true"]);
    baseline = { name: "`podman exec C true` into a running container of the same rootfs", times: await timed(EXECS, () => command("podman", ["exec", podman.container, "true"])) };
  } else {
    const base = await ctx.kiln.kiln.services.templates.resolve("local/base");
    const layer = base.layers[base.layers.length - 1];
    baseline = { name: "bare `runc run /bin/true` (podman is not installed on this host)", times: await bareRun("runc", layer, 20) };
  }
  results.push({
    name: "exec round trip of `true` on a running machine, beside podman exec",
    unit: "ms",
    better: "lower",
    median: median(kiln),
    p99: percentile(kiln, 99),
    baseline: { name: baseline.name, median: median(baseline.times), p99: percentile(baseline.times, 99) },
    goal: "≤ 0.05 × podman exec (ratio ≥ 20)",
    note: `${EXECS} execs each; ${podman ? "podman exec starts conmon and runc exec per call" : "podman not on PATH: bare runc stands in"}`,
  });
}
