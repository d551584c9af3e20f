// What per-machine identity costs a create: machines on their own uid ranges (idmapped layers, disk and volumes,
// a user namespace of their own, made by the mount helper in front of runc) beside a second Kiln with
// KILN_MACHINE_IDENTITY=shared (every machine on one range, the runtime's own namespace: how machines booted before),
// measured alternately so host noise falls on both; and the helper's own part of a boot beside the mount it replaced.

import { execFileSync } from "node:child_process";
import { mkdtemp, mkdir, rm, truncate, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { startTestKiln, TEST_KEY } from "../test/support/kiln.ts";
import { TEST_CACHE_DIR } from "../test/support/paths.ts";
import { prepareIdmountHelper } from "../src/runtime/oci/idmount.ts";
import { createIdRangePool } from "../src/runtime/oci/id-ranges.ts";
import { rangeBase } from "../src/runtime/oci/idmap.ts";
import { createLogger } from "../src/log.ts";

const CREATES = Number(process.env.KILN_BENCH_CREATES ?? 30);
const MOUNTS = 100;

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const shared = await startTestKiln({ env: { KILN_LOG_LEVEL: "info", KILN_MACHINE_IDENTITY: "shared" }, captureLogs: false });
  const results: BenchResult[] = [];
  try {
    const servers = [
      { url: ctx.kiln.url, pool: ctx.kiln.kiln.services.pool, warm: [] as number[], cold: [] as number[], ids: [] as string[] },
      { url: shared.url, pool: shared.kiln.services.pool, warm: [] as number[], cold: [] as number[], ids: [] as string[] },
    ];
    const timeCreate = async (s: (typeof servers)[number], body: Record<string, unknown>) => {
      const t0 = performance.now();
      const m = await api(s.url, TEST_KEY, "POST", "/v1/machines", body);
      await api(s.url, TEST_KEY, "POST", `/v1/machines/${m.id}/exec`, { cmd: "true", args: [] });
      const took = performance.now() - t0;
      s.ids.push(m.id);
      if (s.ids.length > 6) await api(s.url, TEST_KEY, "DELETE", `/v1/machines/${s.ids.shift()}`);
      return took;
    };
    for (let i = 0; i < CREATES; i++) {
      for (const s of i % 2 ? [...servers].reverse() : servers) {
        for (let w = 0; w < 400 && s.pool.stats().ready < s.pool.stats().size; w++) await new Promise((r) => setTimeout(r, 10));
        s.warm.push(await timeCreate(s, { template: "local/base" }));
      }
    }
    for (let i = 0; i < CREATES; i++) for (const s of i % 2 ? [...servers].reverse() : servers) s.cold.push(await timeCreate(s, { template: "local/base", vcpus: 2 }));
    for (const s of servers) for (const id of s.ids) await api(s.url, TEST_KEY, "DELETE", `/v1/machines/${id}`);
    const [mine, before] = servers;
    results.push({
      name: `create → first exec answered, warm pool, own uid range (${CREATES} machines)`,
      unit: "ms",
      better: "lower",
      median: median(mine.warm),
      p99: percentile(mine.warm, 99),
      baseline: { name: "the same on the shared range (KILN_MACHINE_IDENTITY=shared)", median: median(before.warm), p99: percentile(before.warm, 99) },
      note: "pooled machines were booted (helper included) before the request",
    });
    results.push({
      name: `create → first exec answered, cold boot, own uid range (${CREATES} machines)`,
      unit: "ms",
      better: "lower",
      median: median(mine.cold),
      p99: percentile(mine.cold, 99),
      baseline: { name: "the same on the shared range (KILN_MACHINE_IDENTITY=shared)", median: median(before.cold), p99: percentile(before.cold, 99) },
      note: "runc + agent start in the request; the helper's namespace, idmapped mounts and overlay are in it",
    });
    results.push(await helperCost(ctx));
  } finally {
    await shared.close();
  }
  return results;
}

/**
 * The helper's part of a boot alone — the machine's user namespace (owned by its uid, limits set), idmapped layer
 * and disk mounts, the overlay root — running `/bin/true` in place of runc, beside the `mount -t overlay` exec that
 * was the whole of it before. Each round unmounts what it made.
 */
async function helperCost(ctx: BenchContext): Promise<BenchResult> {
  const helper = await prepareIdmountHelper(join(TEST_CACHE_DIR, "bin")); // the servers' own (their cache dir)
  if (!helper.path) throw new Error(helper.problem);
  const base = await ctx.kiln.kiln.services.templates.resolve("local/base");
  const layer = base.layers[base.layers.length - 1];
  const dir = await mkdtemp(join(tmpdir(), "kiln-bench-idmount-"));
  const disk = join(dir, "disk");
  const rootfs = join(dir, "rootfs");
  const image = join(dir, "disk.img");
  await Promise.all([mkdir(disk), mkdir(rootfs)]);
  await writeFile(image, "");
  await truncate(image, 256 * 1024 * 1024);
  execFileSync("mkfs.ext4", ["-q", "-F", "-O", "^has_journal", image]);
  execFileSync("mount", ["-o", "loop", image, disk]);
  execFileSync("mkdir", ["-p", join(disk, "upper"), join(disk, "work")]);
  // A range of the host's pool, as a machine's would be, so the benchmark's ids collide with no machine's.
  const pool = createIdRangePool({ dir: "/var/lib/kiln/id-ranges", log: createLogger({ level: "warn" }) });
  const range = await pool.claim(dir);
  const ids = String(rangeBase(range));
  const helperTimes: number[] = [];
  const mountTimes: number[] = [];
  try {
    for (let i = 0; i < MOUNTS; i++) {
      let t0 = performance.now();
      execFileSync(helper.path, [
        "boot",
        ...["--userns", join(dir, "userns"), "--owner", ids, "--map", ids, "--sysctl", "max_inotify_instances=96", "--rlimit", "msgqueue=819200"],
        ...["--idmap", `100000:${ids}:65536`, "--scratch", join(dir, "idmap"), "--lower", layer, "--disk", disk, "--rootfs", rootfs],
        ...["--", "/bin/true"],
      ]);
      helperTimes.push(performance.now() - t0);
      execFileSync("umount", [rootfs]);
      t0 = performance.now();
      execFileSync("mount", ["-t", "overlay", "overlay", "-o", `lowerdir=${layer},upperdir=${disk}/upper,workdir=${disk}/work`, rootfs]);
      mountTimes.push(performance.now() - t0);
      execFileSync("umount", [rootfs]);
    }
  } finally {
    execFileSync("umount", ["-l", disk]);
    await pool.release(range, dir);
    await rm(dir, { recursive: true, force: true });
  }
  return {
    name: "a boot's mount helper: own user namespace + idmapped layer and disk + overlay root",
    unit: "ms",
    better: "lower",
    median: median(helperTimes),
    p99: percentile(helperTimes, 99),
    baseline: { name: "`mount -t overlay` alone (what a boot ran before)", median: median(mountTimes), p99: percentile(mountTimes, 99) },
    note: "an exec from Node each; the helper then execs the runtime, so a boot runs no more processes than before",
  };
}
