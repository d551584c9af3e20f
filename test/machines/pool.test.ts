// Any size from the warm pool: pooled machines boot in the default size and are given the create's vcpus and memory
// at handout (runc: their cgroup caps). A machine handed out so has exactly what a machine booted in that size has:
// the same cgroup files on the host, and the same nproc and memory limit inside.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

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

test("KILN_WARM_POOL_MAX: the pool grows with the creates it could serve, so a second burst is handed out warm", async () => {
  const g = await startTestKiln({ env: { KILN_WARM_POOL: "1", KILN_WARM_POOL_MAX: "3" } });
  const pool = g.kiln.services.pool;
  const filled = async (n: number) => {
    const deadline = Date.now() + 180_000;
    while (pool.stats().ready < n) {
      if (Date.now() > deadline) throw new Error(`the warm pool did not reach ${n}: ${JSON.stringify(pool.stats())}`);
      await new Promise((r) => setTimeout(r, 50));
    }
  };
  const ids: string[] = [];
  try {
    await filled(1);
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
    assert.equal(pool.stats().size, 3, "three creates in the last minute: a pool of three");
    await filled(3);
    const pooled = new Set(pool.stats().ids);
    const second = await burst();
    assert.deepEqual(second.filter((id) => !pooled.has(id)), [], "every create of the second burst took a pooled machine");
  } finally {
    await Promise.all(ids.map((id) => g.call("DELETE", `/v1/machines/${id}`)));
    await g.close();
  }
});
