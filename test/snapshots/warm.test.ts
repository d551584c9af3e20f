// Machines from a disk snapshot out of the warm pool (runc): a warm machine of the base template takes a copy of the
// snapshot's disk at handout and its running processes are pivoted onto it, instead of a cold boot from the snapshot.
// The child is the snapshot's machine, not the warm one's; children are independent; the warm machine's own disk is
// gone from the host's mounts and files at once and from its loop devices once the child ends. On gVisor the same
// requests boot from the snapshot (a sandbox's kernel cannot see a later host mount): the results must be the same.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { createMachine, stdoutOf, stopSnapshotKiln } from "./support.ts";
import { TEST_RUNTIME } from "../support/paths.ts";

const RUNC = TEST_RUNTIME === "runc";
let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "2" } });
});
after(() => stopSnapshotKiln(k));

const sh = (id: string, cmd: string) => stdoutOf(k, id, cmd);

/** The warm pool's ready machines, once it has `n` (bounded: 20 s). */
async function warmReady(n: number): Promise<string[]> {
  const pool = k.kiln.services.pool;
  for (let i = 0; i < 400 && pool.stats().ready < n; i++) await new Promise((r) => setTimeout(r, 50));
  assert.ok(pool.stats().ready >= n, `the warm pool has ${n} machines ready (${JSON.stringify(pool.stats())})`);
  return pool.stats().ids;
}

/** Loop devices attached to a file of the data dir, as `losetup -a` lists them. */
const loops = () => execFileSync("losetup", ["-a"], { encoding: "utf8" }).split("\n").filter((l) => l.includes(k.dataDir));

test("a fork's children taken from the warm pool see the snapshot's files, not the warm machines', and are independent", async () => {
  const parent = await createMachine(k, {});
  await sh(parent.id, "echo from-parent > /workspace/f; mkdir -p /workspace/data && head -c 1048576 /dev/urandom > /workspace/data/blob && md5sum /workspace/data/blob > /workspace/sum");
  const warm = await warmReady(2);
  // Something only the warm machines have: written into their roots from the host.
  for (const id of warm) writeFileSync(join(k.dataDir, "machines", id, "rootfs", "warm-only"), id);
  const f = await k.call("POST", `/v1/machines/${parent.id}/fork`, { body: { count: 2 } });
  assert.equal(f.status, 201, f.text);
  const kids = f.body.machines as { id: string; disk_mb: number; snapshot_id: string | null }[];
  if (RUNC) assert.deepEqual(kids.map((m) => m.id).sort(), [...warm].sort(), "runc: both children are the warm machines");
  for (const [i, m] of kids.entries()) {
    assert.equal(await sh(m.id, "cat /workspace/f; md5sum -c /workspace/sum >/dev/null && echo sum-ok; test -e /warm-only && echo warm || echo no-warm"), "from-parent\nsum-ok\nno-warm\n");
    assert.equal(await sh(m.id, `echo child${i} > /workspace/mine; cat /etc/hostname`), `${m.id.replaceAll("_", "-")}\n`);
  }
  for (const [i, m] of kids.entries()) assert.equal(await sh(m.id, "cat /workspace/mine"), `child${i}\n`);
  assert.equal(await sh(parent.id, "test -e /workspace/mine && echo yes || echo no"), "no\n");
  for (const m of kids) {
    // What the record says is true: its disk is the pool's image of its id, of its size, mounted as its disk.
    const image = join(k.dataDir, "disks", "machines", `${m.id}.img`);
    assert.ok(existsSync(image), "the child's disk image is where its id says");
    assert.ok(loops().some((l) => l.endsWith(`(${image})`)), `its image is on a loop device: ${loops().join("; ")}`);
    const mounts = readFileSync("/proc/self/mountinfo", "utf8");
    assert.ok(mounts.includes(join(k.dataDir, "machines", m.id, "disk", "mnt")), "its disk is mounted");
    const total = Number((await sh(m.id, "df -Pm / | tail -1 | awk '{print $2}'")).trim());
    assert.ok(total > m.disk_mb * 0.85 && total <= m.disk_mb, `df / shows the child's own disk (${total} MiB of ${m.disk_mb})`);
  }
  if (RUNC) {
    // The warm machines' own disks left the host's mounts and files at handout; each one's filesystem is held only
    // by its machine's first processes (their stdout), so it goes with the machine.
    const held = loops().filter((l) => l.includes("(deleted)"));
    assert.ok(held.length <= kids.length, `at most one old disk per child is still attached: ${held.join("; ")}`);
    for (const m of kids) assert.equal((await k.call("DELETE", `/v1/machines/${m.id}`)).status, 200);
    for (let i = 0; i < 200 && loops().some((l) => l.includes("(deleted)")); i++) await new Promise((r) => setTimeout(r, 25));
    assert.deepEqual(loops().filter((l) => l.includes("(deleted)")), [], "the old disks' loop devices are gone with the children");
    for (const m of kids) assert.ok(!loops().some((l) => l.includes(m.id)), `nothing of ${m.id} stays on a loop device`);
  }
});

test("a create from a snapshot takes a warm machine; with none ready it boots from the snapshot", async () => {
  const parent = await createMachine(k, {});
  await sh(parent.id, "echo kept > /workspace/k");
  const s = await k.call("POST", `/v1/machines/${parent.id}/snapshots`, { body: {} });
  assert.equal(s.status, 201, s.text);
  const warm = await warmReady(2);
  // More than the pool holds: the last ones boot (and the pool's refill races them: any mix is right).
  const made = await Promise.all([0, 1, 2].map(() => createMachine(k, { snapshot: s.body.id })));
  if (RUNC) assert.ok(made.filter((m) => warm.includes(m.id)).length >= 1, "a warm machine was taken");
  for (const m of made) {
    assert.equal(m.snapshot_id, s.body.id);
    assert.equal(await sh(m.id, "cat /workspace/k"), "kept\n");
  }
  // A restart reboots the machine on its own (snapshot's) disk.
  const again = made[0];
  assert.equal((await k.call("POST", `/v1/machines/${again.id}/hibernate`, { body: { mode: "disk" } })).status, 200);
  assert.equal((await k.call("POST", `/v1/machines/${again.id}/resume`)).status, 200);
  assert.equal(await sh(again.id, "cat /workspace/k"), "kept\n");
  assert.equal((await k.call("DELETE", `/v1/snapshots/${s.body.id}`)).status, 200);
});
