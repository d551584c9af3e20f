// Any size from the warm pool: pooled machines boot in the default size and are given the create's vcpus and memory
// at handout (runc: their cgroup caps). A machine handed out so has exactly what a machine booted in that size has:
// the same cgroup files on the host, and the same nproc and memory limit inside.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { createWarmPool } from "../../src/machines/warm-pool.ts";
import type { WarmPool } from "../../src/machines/warm-pool.ts";
import { createAdmission } from "../../src/machines/admission.ts";
import { DEFAULT_DISK_MB } from "../../src/runtime/driver.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "2" } });
});
after(async () => k?.close());

async function poolReady(n: number) {
  const deadline = Date.now() + 120_000;
  while (k.kiln.services.pool.stats().ready < n) {
    if (Date.now() > deadline) throw new Error("the warm pool did not fill");
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** What the host's cgroups say of machine `id`'s caps (v1 here; v2 file names where the host is v2). */
function hostCaps(id: string): Record<string, string> {
  const read = (f: string) => (existsSync(f) ? readFileSync(f, "utf8").trim() : "absent");
  if (existsSync("/sys/fs/cgroup/cgroup.controllers")) return { cpu: read(`/sys/fs/cgroup/kiln/${id}/cpu.max`), memory: read(`/sys/fs/cgroup/kiln/${id}/memory.max`), swap: read(`/sys/fs/cgroup/kiln/${id}/memory.swap.max`) };
  return {
    quota: read(`/sys/fs/cgroup/cpu/kiln/${id}/cpu.cfs_quota_us`),
    period: read(`/sys/fs/cgroup/cpu/kiln/${id}/cpu.cfs_period_us`),
    memory: read(`/sys/fs/cgroup/memory/kiln/${id}/memory.limit_in_bytes`),
    memsw: read(`/sys/fs/cgroup/memory/kiln/${id}/memory.memsw.limit_in_bytes`),
  };
}

/** What the machine itself sees: its cores, its CPU quota and its memory limit (cgroup v1 or v2 inside). */
async function insideCaps(id: string): Promise<string> {
  const cmd = [
    "nproc",
    "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo no-cpu-file",
    "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max 2>/dev/null || echo no-memory-file",
    "grep MemTotal /proc/meminfo",
  ].join("; ");
  const r = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd } });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.body.exit_code, 0, r.body.stderr);
  return r.body.stdout;
}

test("a machine of another size taken from the pool has exactly the requested limits, as one booted in that size", async () => {
  await poolReady(2);
  const pooled = new Set(k.kiln.services.pool.stats().ids);
  const shape = { vcpus: 1, memory_mb: 768 };
  const warm = await k.call("POST", "/v1/machines", { body: shape });
  assert.equal(warm.status, 201, warm.text);
  const resizes = Boolean(k.kiln.services.driver.resize);
  // runc resizes a running machine; gVisor sizes its sandbox at boot, so there the pool serves only its own size.
  assert.equal(pooled.has(warm.body.id), resizes, resizes ? "handed out from the pool" : "booted for this create");
  assert.equal(warm.body.vcpus, 1);
  assert.equal(warm.body.memory_mb, 768);
  // The same size booted cold (internet off: the pool holds only machines with it on).
  const cold = await k.call("POST", "/v1/machines", { body: { ...shape, internet: false } });
  assert.equal(cold.status, 201, cold.text);
  assert.ok(!pooled.has(cold.body.id));
  assert.deepEqual(hostCaps(warm.body.id), hostCaps(cold.body.id));
  if (!existsSync("/sys/fs/cgroup/cgroup.controllers")) {
    assert.equal(hostCaps(warm.body.id).quota, "100000", "1 vcpu: 100 ms of CPU per 100 ms");
    assert.equal(hostCaps(warm.body.id).memory, String(768 * 1024 * 1024));
  }
  assert.equal(await insideCaps(warm.body.id), await insideCaps(cold.body.id));
  // Past its new memory limit the machine is held to it (a 900 MiB allocation cannot succeed in 768 MiB).
  const big = await k.call("POST", `/v1/machines/${warm.body.id}/exec`, { body: { cmd: "python3 -c 'b = bytearray(900 * 1024 * 1024); print(len(b))' 2>&1 || perl -e '$x = \"a\" x (900*1024*1024); print length($x)' 2>&1; echo exit=$?", timeout_s: 60 } });
  if (big.status === 200) assert.doesNotMatch(big.body.stdout, /^943718400$/m, "an allocation past the limit does not succeed");
  for (const id of [warm.body.id, cold.body.id]) assert.equal((await k.call("DELETE", `/v1/machines/${id}`)).status, 200);
});

test("a pooled machine given a larger size keeps it across a reboot from its disk", async () => {
  await poolReady(1);
  const pooled = new Set(k.kiln.services.pool.stats().ids);
  const m = await k.call("POST", "/v1/machines", { body: { vcpus: 2, memory_mb: 1024 } });
  assert.equal(m.status, 201, m.text);
  if (!k.kiln.services.driver.resize) assert.ok(!pooled.has(m.body.id));
  const before = hostCaps(m.body.id);
  const slept = await k.call("POST", `/v1/machines/${m.body.id}/hibernate`, { body: { mode: "disk" } });
  assert.equal(slept.status, 200, slept.text);
  const woke = await k.call("POST", `/v1/machines/${m.body.id}/resume`);
  assert.equal(woke.status, 200, woke.text);
  assert.deepEqual(hostCaps(m.body.id), before);
  if (!existsSync("/sys/fs/cgroup/cgroup.controllers")) assert.equal(before.memory, String(1024 * 1024 * 1024));
  assert.equal((await k.call("DELETE", `/v1/machines/${m.body.id}`)).status, 200);
});

/** Waits (polling the pool, bounded) until `ok` holds of its stats; meanwhile checks `always` on every look. */
async function poolUntil(pool: WarmPool, what: string, ok: (s: ReturnType<WarmPool["stats"]>) => boolean, always?: (s: ReturnType<WarmPool["stats"]>) => void) {
  const deadline = Date.now() + 180_000;
  for (;;) {
    const s = pool.stats();
    always?.(s);
    if (ok(s)) return;
    if (Date.now() > deadline) throw new Error(`the warm pool did not get to: ${what} (${JSON.stringify(s)})`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

test("by default the pool follows demand: a burst grows it so the next burst is handed out warm, and it shrinks back once the creates stop", async () => {
  // No KILN_WARM_POOL_MAX: the default (auto). An idle window long enough for the refills of a loaded host, short
  // enough that the shrink comes within the test.
  const g = await startTestKiln({ env: { KILN_WARM_POOL: "1", KILN_WARM_POOL_IDLE_S: "15" } });
  const pool = g.kiln.services.pool;
  const ids: string[] = [];
  try {
    assert.ok(pool.stats().max >= 3, `auto lets the pool grow on this host: ${JSON.stringify(pool.stats())}`);
    await poolUntil(pool, "1 ready", (s) => s.ready >= 1);
    assert.equal(pool.stats().size, 1);
    // A shape the pool cannot hold is no demand for it.
    const off = await g.call("POST", "/v1/machines", { body: { internet: false } });
    assert.equal(off.status, 201, off.text);
    ids.push(off.body.id);
    assert.equal(pool.stats().size, 1, "an internet-off create does not grow the pool");
    const burst = async () => {
      const made = await Promise.all([0, 1, 2].map(() => g.call("POST", "/v1/machines", { body: {} })));
      for (const m of made) assert.equal(m.status, 201, m.text);
      ids.push(...made.map((m) => m.body.id));
      return made.map((m) => m.body.id as string);
    };
    await burst();
    assert.equal(pool.stats().size, 3, "three creates within a second: a pool of three");
    await poolUntil(pool, "3 ready", (s) => s.ready >= 3);
    const pooled = new Set(pool.stats().ids);
    const second = await burst();
    assert.deepEqual(second.filter((id) => !pooled.has(id)), [], "every create of the second burst took a pooled machine");
    const dels = await Promise.all(ids.splice(0).map((id) => g.call("DELETE", `/v1/machines/${id}`)));
    for (const d of dels) assert.equal(d.status, 200, d.text);
    // The second burst's refills bring it back to three; with no create for the idle window it goes back to one.
    await poolUntil(pool, "back to its size", (s) => s.size === 1 && s.ready + s.booting <= 1);
    await poolUntil(pool, "refilled to its size", (s) => s.ready === 1);
    // What it released is destroyed: the runtime holds only the one pooled machine.
    const kept = pool.stats().ids;
    const deadline = Date.now() + 60_000;
    let live = (await g.kiln.services.driver.listLive()).map((m) => m.id);
    while (live.some((id) => !kept.includes(id)) && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 200));
      live = (await g.kiln.services.driver.listLive()).map((m) => m.id);
    }
    assert.deepEqual(live, kept, "the released idle machines are destroyed");
  } finally {
    await Promise.all(ids.map((id) => g.call("DELETE", `/v1/machines/${id}`)));
    await g.close();
  }
});

test("the default bound comes from the memory floor: a burst larger than it grows the pool only to it", async () => {
  // 64 MiB of floor is two idle machines' worth (32 MiB each): a burst of four asks for four, the pool keeps two.
  const g = await startTestKiln({ env: { KILN_WARM_POOL: "1", KILN_MIN_FREE_MEMORY_MB: "64" } });
  const pool = g.kiln.services.pool;
  const ids: string[] = [];
  const within = (s: ReturnType<WarmPool["stats"]>) => assert.ok(s.ready + s.booting <= 2, `the pool stays within its bound: ${JSON.stringify(s)}`);
  try {
    assert.equal(pool.stats().max, 2);
    await poolUntil(pool, "1 ready", (s) => s.ready >= 1, within);
    const made = await Promise.all([0, 1, 2, 3].map(() => g.call("POST", "/v1/machines", { body: {} })));
    for (const m of made) assert.equal(m.status, 201, m.text);
    ids.push(...made.map((m) => m.body.id));
    assert.equal(pool.stats().size, 2, "four creates within a second, a bound of two");
    await poolUntil(pool, "2 ready", (s) => s.ready >= 2, within);
    // It stays there (no boot above the bound is started later).
    for (let i = 0; i < 20; i++) {
      within(pool.stats());
      await new Promise((r) => setTimeout(r, 50));
    }
  } finally {
    await Promise.all(ids.map((id) => g.call("DELETE", `/v1/machines/${id}`)));
    await g.close();
  }
});

test("above its size the pool boots only while the host is above the admission floors", async () => {
  // A real admission whose memory floor no host meets, and one with no floor, on the server's own driver.
  const db = k.kiln.services.store.db;
  const limits = { dataDir: k.dataDir, maxDiskMb: 1 << 20, minFreeDiskMb: 0 };
  const base = await k.kiln.services.templates.resolve("local/base");
  const shape = { artifactId: base.artifact.id, layers: base.layers, vcpus: 1, memoryMb: 1024 };
  const want = { artifactId: base.artifact.id, vcpus: 1, memoryMb: 1024, diskMb: DEFAULT_DISK_MB, internet: true, network: false };
  for (const [floor, grows] of [[1 << 30, false], [0, true]] as const) {
    const admission = createAdmission({ db, limits: { ...limits, minFreeMemoryMb: floor } });
    const p = createWarmPool({ driver: k.kiln.services.driver, size: 1, demand: { max: 3, room: () => admission.idleRoom(512) }, log: k.kiln.log });
    const taken: string[] = [];
    try {
      p.configure(shape);
      await poolUntil(p, "its size", (s) => s.ready >= 1, (s) => assert.ok(s.ready + s.booting <= 1 || grows, JSON.stringify(s)));
      for (let i = 0; i < 3; i++) {
        const live = p.take(want);
        if (live) taken.push(live.id);
      }
      assert.equal(p.stats().size, 3, "three asks within a second");
      if (grows) await poolUntil(p, "grown to 3", (s) => s.ready >= 3);
      else {
        // Under the floor: it keeps (and refills) its size only.
        await poolUntil(p, "refilled to its size", (s) => s.ready >= 1, (s) => assert.ok(s.ready + s.booting <= 1, `no boot above the size under the floor: ${JSON.stringify(s)}`));
        for (let i = 0; i < 20; i++) {
          assert.ok(p.stats().ready + p.stats().booting <= 1, JSON.stringify(p.stats()));
          await new Promise((r) => setTimeout(r, 50));
        }
      }
    } finally {
      await p.close();
      await Promise.all(taken.map((id) => k.kiln.services.driver.destroy(id)));
    }
  }
});

test("a burst's boots above the size ask for room as each starts, not only as they are queued: memory one took stops the rest", async () => {
  // The host has room for one idle machine above the pool's size: once a second machine is up, room() says no — as a
  // real floor would once the first boot's memory was taken. Boots go one at a time (one slot), as behind creates.
  const real = k.kiln.services.driver;
  let booted = 0;
  // Counted once up, as memory is taken once a machine runs (not when its boot is queued or started).
  const driver = {
    ...real,
    create: async (spec: Parameters<typeof real.create>[0]) => {
      const live = await real.create(spec);
      booted++;
      return live;
    },
  };
  const base = await k.kiln.services.templates.resolve("local/base");
  const shape = { artifactId: base.artifact.id, layers: base.layers, vcpus: 1, memoryMb: 1024 };
  const want = { artifactId: base.artifact.id, vcpus: 1, memoryMb: 1024, diskMb: DEFAULT_DISK_MB, internet: true, network: false };
  const { createBootQueue } = await import("../../src/machines/boot-queue.ts");
  const p = createWarmPool({ driver, size: 1, demand: { max: 4, room: () => booted < 2 }, boots: createBootQueue(1), log: k.kiln.log });
  const taken: string[] = [];
  try {
    p.configure(shape);
    await poolUntil(p, "its size", (s) => s.ready >= 1);
    // Four asks within a second: the target is 4; the size's refill starts, and three boots above it are queued while
    // room() still says yes (nothing of the refill is up yet).
    for (let i = 0; i < 4; i++) {
      const live = p.take(want);
      if (live) taken.push(live.id);
    }
    assert.equal(p.stats().size, 4);
    await poolUntil(p, "its boots settled", (s) => s.booting === 0 && s.ready >= 1);
    assert.equal(booted, 2, "the size's refill booted, and no boot above it once the host had no room");
    assert.equal(p.stats().ready, 1, JSON.stringify(p.stats()));
  } finally {
    await p.close();
    await Promise.all(taken.map((id) => real.destroy(id)));
  }
});
