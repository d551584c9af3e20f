// Snapshots and the host's disk, on the runtime of this run: the blocks a snapshot keeps apart from its machine are
// taken from the data dir's filesystem (what disk admission reads as free_disk_mb) once the machine rewrites them, and
// given back when the snapshot is deleted; GET /v1/ready and /metrics show how many snapshots there are and what
// they hold.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { existsSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

const MIB = 1024 * 1024;
let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => {
  const dataDir = k.dataDir;
  await k?.close();
  assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(dataDir), "nothing of the data dir stays mounted");
  assert.ok(!execFileSync("losetup", ["-a"], { encoding: "utf8" }).includes(dataDir), "no loop device on a file of the data dir");
});

async function sh(id: string, cmd: string) {
  const res = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd, timeout_s: 120 } });
  assert.equal(res.status, 200, res.text);
  assert.equal(res.body.exit_code, 0, res.text);
  return res.body.stdout as string;
}

/** Bytes of the data dir's filesystem the disk pool takes: its sparse XFS file's allocated blocks, all writes flushed. */
function poolBytes(): number {
  execFileSync("sync");
  return statSync(join(k.dataDir, "disks.xfs")).blocks * 512;
}

async function metric(name: string): Promise<number> {
  const res = await k.call("GET", "/metrics");
  assert.equal(res.status, 200, res.text);
  const line = res.text.split("\n").find((l) => l.startsWith(`${name}{`));
  return line ? Number(line.split(" ").at(-1)) : 0;
}

test("disk admission counts snapshots: what a snapshot keeps apart takes the data dir's space, its delete gives it back; /v1/ready and /metrics show it", async (t) => {
  const created = await k.call("POST", "/v1/machines", { body: {} });
  assert.equal(created.status, 201, created.text);
  const m = created.body.id as string;
  if (!existsSync(join(k.dataDir, "disks.xfs"))) return t.skip("the data dir reflinks itself: no pool file to measure");
  // 64 MiB the machine writes, then rewrites in place: without a snapshot a rewrite takes no new space.
  await sh(m, "dd if=/dev/urandom of=/workspace/big bs=1M count=64 iflag=fullblock status=none && sync");
  const written = poolBytes();
  await sh(m, "dd if=/dev/urandom of=/workspace/big bs=1M count=64 iflag=fullblock conv=notrunc status=none && sync");
  const rewritten = poolBytes();
  assert.ok(rewritten - written < 24 * MIB, `a rewrite in place takes no new space (${(rewritten - written) / MIB} MiB)`);

  const readyBefore = (await k.call("GET", "/v1/ready")).body.capacity;
  assert.deepEqual(readyBefore.snapshots, { count: 0, bytes: 0 });
  const s = await k.call("POST", `/v1/machines/${m}/snapshots`, { body: {} });
  assert.equal(s.status, 201, s.text);
  const ready = (await k.call("GET", "/v1/ready")).body.capacity;
  assert.equal(ready.snapshots.count, 1);
  assert.equal(ready.snapshots.bytes, s.body.size_bytes);
  assert.ok(ready.snapshots.bytes >= 64 * MIB, `the snapshot's blocks are counted (${ready.snapshots.bytes})`);
  assert.equal(await metric("kiln_snapshots"), 1);
  assert.equal(await metric("kiln_snapshot_bytes"), s.body.size_bytes);

  // The machine rewrites the same blocks: the snapshot keeps the old ones, so the pool (and the data dir) grows.
  await sh(m, "dd if=/dev/urandom of=/workspace/big bs=1M count=64 iflag=fullblock conv=notrunc status=none && sync");
  const kept = poolBytes();
  assert.ok(kept - rewritten >= 48 * MIB, `the snapshot's own blocks take the data dir's space (${(kept - rewritten) / MIB} MiB)`);

  // Deleted, its blocks are holes of the pool file again (XFS discards them), within a bound.
  assert.equal((await k.call("DELETE", `/v1/snapshots/${s.body.id}`)).status, 200);
  let after = poolBytes();
  for (let i = 0; i < 100 && kept - after < 48 * MIB; i++) {
    await new Promise((r) => setTimeout(r, 100));
    after = poolBytes();
  }
  assert.ok(kept - after >= 48 * MIB, `a deleted snapshot's space is given back (${(kept - after) / MIB} MiB)`);
  assert.deepEqual((await k.call("GET", "/v1/ready")).body.capacity.snapshots, { count: 0, bytes: 0 });
  assert.equal(await metric("kiln_snapshot_bytes"), 0);
  await k.call("DELETE", `/v1/machines/${m}`);
});
