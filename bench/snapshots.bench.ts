// Snapshots and forks of a running runc machine that has written 300 MB, beside a `cp` of the same disk image (the
// cost without a reflink pool); under gVisor, a memory snapshot of a machine using 256 MiB and the restore to its
// first exec beside bare `runsc checkpoint`/`restore`-through-Kiln, and how much memory a memory hibernate releases.
// The runc forks are measured twice: without a warm pool (cold boots from the snapshot) and with 10 warm machines
// (each child takes one: its disk swapped at handout), the first being the second's baseline.
// KILN_BENCH_SNAPSHOT_ROUNDS (default 5) rounds; KILN_BENCH_SNAPSHOT_RUNC_ONLY=1 leaves gVisor out,
// KILN_BENCH_SNAPSHOT_GVISOR_ONLY=1 runc.

import { execFileSync } from "node:child_process";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { startTestKiln } from "../test/support/kiln.ts";
import type { TestKiln } from "../test/support/kiln.ts";

const ROUNDS = Number(process.env.KILN_BENCH_SNAPSHOT_ROUNDS ?? 5);

const ms = (t0: number) => performance.now() - t0;

function caller(k: TestKiln, key: string) {
  return (method: string, path: string, body?: unknown) => api(k.url, key, method, path, body);
}

/** Waits (untimed, bounded: 60 s) until the warm pool has `n` machines ready: forks are timed from a full pool. */
async function warmReady(k: TestKiln, n: number): Promise<void> {
  const pool = k.kiln.services.pool;
  for (let i = 0; i < 1200 && pool.stats().ready < n; i++) await new Promise((r) => setTimeout(r, 50));
  if (pool.stats().ready < n) throw new Error(`the warm pool did not reach ${n} ready machines: ${JSON.stringify(pool.stats())}`);
}

/**
 * With `warm` > 0 the server keeps that many warm machines, and each fork is timed once the pool is full again: its
 * children take warm machines (runc: the snapshot's disk swapped in under them) instead of booting.
 */
async function runcNumbers(k: TestKiln, key: string, warm = 0): Promise<BenchResult[]> {
  const call = caller(k, key);
  const parent = await call("POST", "/v1/machines", {});
  await call("POST", `/v1/machines/${parent.id}/exec`, { cmd: "head -c 300M /dev/urandom > /var/tmp/big && sync", timeout_s: 300 });
  const image = join(k.dataDir, "disks", "machines", `${parent.id}.img`);
  const snap: number[] = [];
  const fork1: number[] = [];
  const fork10: number[] = [];
  const copy: number[] = [];
  for (let i = 0; i < ROUNDS; i++) {
    let t0 = performance.now();
    const s = await call("POST", `/v1/machines/${parent.id}/snapshots`, {});
    snap.push(ms(t0));
    await call("DELETE", `/v1/snapshots/${s.id}`);
    if (warm) await warmReady(k, 1);
    t0 = performance.now();
    const one = await call("POST", `/v1/machines/${parent.id}/fork`, { count: 1 });
    await call("POST", `/v1/machines/${one.machines[0].id}/exec`, { cmd: "true" });
    fork1.push(ms(t0));
    for (const m of one.machines) await call("DELETE", `/v1/machines/${m.id}`);
    // The baseline: what a snapshot costs without reflink, a sparse copy of the same image onto the data dir's own
    // filesystem (ext4 here) and its flush. (Within the pool, cp's copy_file_range would itself reflink.)
    const dest = join(k.dataDir, "bench-copy.img");
    t0 = performance.now();
    execFileSync("sh", ["-c", `cp --reflink=never --sparse=always '${image}' '${dest}' && sync '${dest}'`]);
    copy.push(ms(t0));
    rmSync(dest, { force: true });
  }
  for (let i = 0; i < Math.max(1, Math.floor(ROUNDS / 2)); i++) {
    if (warm) await warmReady(k, Math.min(10, warm));
    const t0 = performance.now();
    const ten = await call("POST", `/v1/machines/${parent.id}/fork`, { count: 10 });
    fork10.push(ms(t0));
    for (const m of ten.machines) await call("DELETE", `/v1/machines/${m.id}`);
  }
  await call("DELETE", `/v1/machines/${parent.id}`);
  const base = { name: "cp --sparse of the same 10 GiB disk image holding 300 MB onto the data dir's ext4, and sync", median: median(copy), p99: percentile(copy, 99) };
  if (warm) {
    return [
      { name: `runc: fork of that machine → the child answers its first exec, ${warm} warm machines kept`, unit: "ms", better: "lower", median: median(fork1), p99: percentile(fork1, 99), baseline: base, goal: "≤ 150 ms (CubeSandbox's clone: 220 ms)" },
      { name: `runc: 10 forks of that machine in one call, all running, ${warm} warm machines kept`, unit: "ms", better: "lower", median: median(fork10), p99: percentile(fork10, 99), baseline: { ...base, median: base.median * 10, p99: base.p99 * 10, name: "10 × " + base.name }, goal: "≤ 1 s" },
    ];
  }
  return [
    { name: "runc: snapshot of a running machine that wrote 300 MB", unit: "ms", better: "lower", median: median(snap), p99: percentile(snap, 99), baseline: base, goal: "≤ 100 ms", note: `machines' disks on ${poolKind(k)} (reflink)` },
    { name: "runc: fork of that machine → the child answers its first exec", unit: "ms", better: "lower", median: median(fork1), p99: percentile(fork1, 99), baseline: base, goal: "≤ 150 ms (CubeSandbox's clone: 220 ms)" },
    { name: "runc: 10 forks of that machine in one call, all running", unit: "ms", better: "lower", median: median(fork10), p99: percentile(fork10, 99), baseline: { ...base, median: base.median * 10, p99: base.p99 * 10, name: "10 × " + base.name }, goal: "≤ 1 s" },
  ];
}

function poolKind(k: TestKiln): string {
  return execFileSync("stat", ["-f", "-c", "%T", join(k.dataDir, "disks")], { encoding: "utf8" }).trim();
}

function cgroupMemory(id: string): number | null {
  for (const file of [`/sys/fs/cgroup/memory/kiln/${id}/memory.usage_in_bytes`, `/sys/fs/cgroup/kiln/${id}/memory.current`]) {
    try {
      return Number(readFileSync(file, "utf8").trim());
    } catch {
      // the other cgroup version, or gone
    }
  }
  return null;
}

const HOLD_256_PY = "import time; b = bytearray(256 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); time.sleep(86400)";

/**
 * The baseline of a memory snapshot: bare `runsc checkpoint` (uncompressed, as Kiln asks for it) of a sandbox whose
 * one process holds 256 MiB, on the base template's rootfs, and `runsc restore` of it — no agent, network, disk copy
 * or records.
 */
export async function bareRunscCheckpoint(layer: string, n: number): Promise<{ checkpoint: number[]; restore: number[] }> {
  const dir = mkdtempSync(join(tmpdir(), "kiln-bench-ckpt-"));
  const runsc = (args: string[]) => execFileSync("runsc", ["--root", join(dir, "state"), "--platform=ptrace", "--network=none", ...args], { stdio: "ignore" });
  const checkpoint: number[] = [];
  const restore: number[] = [];
  try {
    execFileSync("runsc", ["spec", "--bundle", dir]);
    const spec = JSON.parse(readFileSync(join(dir, "config.json"), "utf8"));
    spec.root = { path: layer, readonly: true };
    spec.process.args = ["python3", "-c", HOLD_256_PY];
    spec.process.terminal = false;
    writeFileSync(join(dir, "config.json"), JSON.stringify(spec));
    mkdirSync(join(dir, "state"));
    for (let i = 0; i < n; i++) {
      const id = `kiln-bench-ckpt-${process.pid}-${i}`;
      const image = join(dir, `image-${i}`);
      mkdirSync(image);
      runsc(["run", "--detach", "--bundle", dir, id]);
      try {
        await new Promise((r) => setTimeout(r, 3000)); // the process fills its 256 MiB
        let t0 = performance.now();
        runsc(["checkpoint", "--compression=none", "--direct", "--image-path", image, id]);
        checkpoint.push(ms(t0));
        runsc(["delete", "--force", id]);
        t0 = performance.now();
        runsc(["restore", "--detach", "--image-path", image, "--bundle", dir, id]);
        restore.push(ms(t0));
      } finally {
        try {
          runsc(["delete", "--force", id]);
        } catch {
          // already gone
        }
        rmSync(image, { recursive: true, force: true });
      }
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
  return { checkpoint, restore };
}

async function gvisorNumbers(key: string): Promise<BenchResult[]> {
  try {
    execFileSync("runsc", ["--version"], { stdio: "ignore" });
  } catch {
    process.stderr.write("  runsc is not installed: no memory snapshot numbers\n");
    return [];
  }
  const env = { KILN_LOG_LEVEL: "warn", KILN_OCI_RUNTIME: "runsc", KILN_WARM_POOL: "0" };
  const k = await startTestKiln({ env });
  // The same restore with no disk made ready ahead (as before snapshot-spares.ts), on a second server whose rounds
  // alternate with the first's: both under the same load.
  const plain = await startTestKiln({ env: { ...env, KILN_SNAPSHOT_SPARES: "0" } });
  try {
    const hold = `nohup python3 -c "${HOLD_256_PY}" >/dev/null 2>&1 & sleep 3`;
    const snap: number[] = [];
    const back: number[] = [];
    const restore: number[] = [];
    const restorePlain: number[] = [];
    const stop: number[] = [];
    const released: number[] = [];
    const round = async (server: TestKiln, restored: number[], all: boolean) => {
      const call = caller(server, key);
      const m = await call("POST", "/v1/machines", { internet: false, memory_mb: 1024 });
      await call("POST", `/v1/machines/${m.id}/exec`, { cmd: hold, timeout_s: 60 });
      let t0 = performance.now();
      const s = await call("POST", `/v1/machines/${m.id}/snapshots`, { memory: true });
      if (all) snap.push(ms(t0));
      // The snapshot answers before its machine is restored from it: how long until the machine itself answers again.
      await call("POST", `/v1/machines/${m.id}/exec`, { cmd: "true" });
      if (all) back.push(ms(t0));
      t0 = performance.now();
      const child = await call("POST", "/v1/machines", { snapshot: s.id });
      await call("POST", `/v1/machines/${child.id}/exec`, { cmd: "true" });
      restored.push(ms(t0));
      if (all) {
        const before = cgroupMemory(m.id);
        t0 = performance.now();
        await call("POST", `/v1/machines/${m.id}/hibernate`, { memory: true });
        stop.push(ms(t0));
        const after = cgroupMemory(m.id) ?? 0;
        if (before) released.push(100 * (1 - after / before));
      }
      for (const id of [m.id, child.id]) await call("DELETE", `/v1/machines/${id}`);
      await call("DELETE", `/v1/snapshots/${s.id}`);
    };
    for (let i = 0; i < Math.max(2, Math.floor(ROUNDS / 2)); i++) {
      await round(k, restore, true);
      await round(plain, restorePlain, false);
    }
    const base = await k.kiln.services.templates.resolve("local/base");
    const bare = await bareRunscCheckpoint(base.layers[base.layers.length - 1], 3);
    const bareCheckpoint = { name: "bare runsc checkpoint (uncompressed, --direct as Kiln) of a sandbox whose process holds 256 MiB", median: median(bare.checkpoint), p99: percentile(bare.checkpoint, 99) };
    const bareRestore = { name: "bare runsc restore of that checkpoint", median: median(bare.restore), p99: percentile(bare.restore, 99) };
    return [
      { name: "gVisor: memory snapshot of a running machine holding 256 MiB", unit: "ms", better: "lower", median: median(snap), p99: percentile(snap, 99), baseline: bareCheckpoint, goal: "≤ 1 s", note: "the machine is saved (O_DIRECT) and its disk reflinked; the answer does not wait for its restore" },
      { name: "gVisor: memory snapshot → that machine answers its next exec", unit: "ms", better: "lower", median: median(back), p99: percentile(back, 99), baseline: bareCheckpoint, note: "the snapshot answers once saved; the machine is restored from it after the answer, and requests to it wait meanwhile" },
      { name: "gVisor: machine from that memory snapshot → first exec", unit: "ms", better: "lower", median: median(restore), p99: percentile(restore, 99), baseline: bareRestore, goal: "≤ 500 ms", note: "its disk made ready ahead (KILN_SNAPSHOT_SPARES)" },
      { name: "gVisor: machine from that memory snapshot → first exec, no disk ready ahead", unit: "ms", better: "lower", median: median(restorePlain), p99: percentile(restorePlain, 99), baseline: bareRestore, note: "KILN_SNAPSHOT_SPARES=0, rounds alternating with the row above's" },
      { name: "gVisor: memory hibernate of that machine", unit: "ms", better: "lower", median: median(stop), p99: percentile(stop, 99) },
      { name: "gVisor: memory a memory hibernate releases (cgroup usage before/after)", unit: "%", better: "higher", median: median(released), p99: percentile(released, 1), goal: "≥ 90 %" },
    ];
  } catch (err) {
    // The runc numbers stand on their own: report why these are missing instead of losing both.
    process.stderr.write(`  no gVisor snapshot numbers: ${(err as Error).message}\n`);
    for (const line of [...k.logs, ...plain.logs]) if (/"level":50/.test(line)) process.stderr.write(line.slice(0, 2000) + "\n");
    return [];
  } finally {
    await Promise.all([k.close(), plain.close()]);
  }
}

/** Forks taken from a warm pool of 10 machines (as many as the 10-fork call needs). */
async function warmNumbers(key: string): Promise<BenchResult[]> {
  const k = await startTestKiln({ env: { KILN_LOG_LEVEL: "warn", KILN_WARM_POOL: "10" } });
  try {
    return await runcNumbers(k, key, 10);
  } catch (err) {
    for (const line of k.logs) if (/"level":50/.test(line)) process.stderr.write(line.slice(0, 2000) + "\n");
    throw err;
  } finally {
    await k.close();
  }
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  // KILN_BENCH_SNAPSHOT_GVISOR_ONLY=1: the gVisor rows alone (their runc rows take minutes).
  if (process.env.KILN_BENCH_SNAPSHOT_GVISOR_ONLY) return gvisorNumbers(ctx.key);
  const k = await startTestKiln({ env: { KILN_LOG_LEVEL: "warn", KILN_WARM_POOL: "0" } });
  try {
    const cold = await runcNumbers(k, ctx.key);
    await k.close();
    const warm = await warmNumbers(ctx.key);
    // The rows without a warm pool are the warm rows' baselines (measured in this run), in place of the copy.
    for (const row of warm) {
      const coldRow = cold.find((c) => c.name === row.name.replace(/, \d+ warm machines kept$/, ""));
      if (coldRow) row.baseline = { name: `the same with no warm machine (a boot from the snapshot's disk)`, median: coldRow.median, p99: coldRow.p99 };
    }
    if (process.env.KILN_BENCH_SNAPSHOT_RUNC_ONLY) return [...cold, ...warm];
    return [...cold, ...warm, ...(await gvisorNumbers(ctx.key))];
  } catch (err) {
    // What the server said about it (its errors only: the run is otherwise quiet).
    for (const line of k.logs) if (/"level":50/.test(line)) process.stderr.write(line.slice(0, 2000) + "\n");
    throw err;
  } finally {
    await k.close();
  }
}
