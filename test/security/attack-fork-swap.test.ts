// Attacks on the runc fork path that swaps a snapshot's disk in under a warm machine (idmount.c --swap-into,
// docs/snapshots.md): machine root of the parent crafts its disk (symlinked mount points, fifos, odd modes, huge
// sparse files), forks, and the child must come up confined as any machine — its mounts inside its own root, nothing
// of it propagated to or placed on the host, its own uid range — or, where the swap cannot be made, be booted from the
// snapshot with nothing of the attempt left mounted or on a loop device.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { chmodSync, existsSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { createMachine, stopSnapshotKiln } from "../snapshots/support.ts";
import { TEST_RUNTIME } from "../support/paths.ts";

const RUNC = TEST_RUNTIME === "runc";
let k: TestKiln;
// The data dir lies on a shared mount, as under systemd (its / is shared): a mount the swap makes in the child's new
// root would show up on the host through it.
const shared = mkdtempSync(join(tmpdir(), "kiln-shared-"));
before(async () => {
  if (!RUNC) return;
  chmodSync(shared, 0o711);
  execFileSync("mount", ["--bind", shared, shared]);
  execFileSync("mount", ["--make-shared", shared]);
  k = await startTestKiln({ dataDir: join(shared, "data"), env: { KILN_WARM_POOL: "1" } });
});
after(async () => {
  try {
    await stopSnapshotKiln(k);
  } finally {
    if (RUNC) execFileSync("umount", [shared]);
    rmSync(shared, { recursive: true, force: true });
  }
});

async function root(id: string, cmd: string): Promise<string> {
  const res = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd, user: "root", timeout_s: 60 } });
  assert.equal(res.status, 200, res.text);
  return `${res.body.stdout}${res.body.stderr ? `\n[stderr] ${res.body.stderr}` : ""}`;
}

/** The warm pool's ready machines, once it has one (bounded: 20 s). */
async function warmReady(): Promise<string[]> {
  const pool = k.kiln.services.pool;
  for (let i = 0; i < 400 && pool.stats().ready < 1; i++) await new Promise((r) => setTimeout(r, 50));
  assert.ok(pool.stats().ready >= 1, `the warm pool has a machine ready (${JSON.stringify(pool.stats())})`);
  return pool.stats().ids;
}

const hostMounts = () =>
  readFileSync("/proc/self/mountinfo", "utf8")
    .split("\n")
    .filter(Boolean)
    .map((l) => l.split(" ")[4]!);

/** The parent's disk as its machine root could have left it: `craft` runs on the host in its upper dir (odd entries machine root cannot make from inside, its mount points being busy there). */
function craft(id: string, script: string): void {
  execFileSync("sh", ["-ec", `umask 022\n${script}`], { cwd: join(k.dataDir, "machines", id, "disk", "mnt", "upper") });
}

async function fork(parentId: string): Promise<{ id: string }> {
  await warmReady();
  const f = await k.call("POST", `/v1/machines/${parentId}/fork`, { body: { count: 1 } });
  assert.equal(f.status, 201, f.text);
  return f.body.machines[0];
}

const swapFailures = () => k.logs.join("").split("\n").filter((l) => l.includes("could not take the snapshot's disk"));
/**
 * Host mounts outside this Kiln's data dir (none may appear: nothing of a machine is placed on the host) — but other
 * test servers' (their data dirs and network namespaces), which come and go on a shared host meanwhile.
 */
const foreignMounts = () => hostMounts().filter((m) => !m.startsWith(k.dataDir) && !/^\/(tmp\/kiln-(?!shared-)|run\/netns\/)/.test(m));

test("on a host whose mounts are shared, the child is the warm machine swapped and nothing of it reaches the host", { skip: !RUNC && "the swap is runc's" }, async () => {
  const parent = await createMachine(k, {});
  await root(parent.id, "echo from-parent > /workspace/f");
  const [warm] = await warmReady();
  const outside = foreignMounts();
  const failed = swapFailures().length;
  const child = await fork(parent.id);
  assert.equal(swapFailures().length, failed, `the swap was made: ${swapFailures().at(-1)}`);
  assert.equal(child.id, warm, "the child is the warm machine");
  assert.equal(await root(child.id, "cat /workspace/f"), "from-parent\n");
  // Its /proc, /dev, /sys, /opt/kiln and /etc files are the machine's own mounts: none of them on the host.
  assertNoLeftovers(child.id, outside, "swapped");
  await destroyAll([child.id, parent.id]);
});

test("symlinked mount points in a forked disk land inside the child's root, nothing on the host", { skip: !RUNC && "the swap is runc's" }, async () => {
  const parent = await createMachine(k, {});
  await root(parent.id, "mkdir -p /srv/landing /etc/real && echo secret-parent > /srv/landing/mine");
  // /opt climbs out by .. (relative), /etc/resolv.conf is a fifo, /etc/hostname an absolute symlink to a host path.
  craft(
    parent.id,
    [
      "mkdir -p etc",
      "ln -s ../../../../../../../../../srv/landing opt",
      "rm -f etc/resolv.conf && mkfifo etc/resolv.conf",
      `ln -sf ${k.dataDir}/hostname-target etc/hostname`,
      `mkdir -p .${k.dataDir} && : > .${k.dataDir}/hostname-target`,
      `chown -h 100000:100000 opt etc/resolv.conf etc/hostname && chown -R 100000:100000 ./${k.dataDir.split("/")[1]}`,
    ].join("\n"),
  );
  const outside = foreignMounts();
  const failed = swapFailures().length;
  const child = await fork(parent.id);
  assert.equal(swapFailures().length, failed, `the warm machine took the crafted disk: ${swapFailures().at(-1)}`);
  const mounts = await root(child.id, "cat /proc/self/mountinfo");
  const points = mounts.split("\n").filter(Boolean).map((l) => l.split(" ")[4]);
  assert.ok(points.includes("/srv/landing/kiln"), `the guest runtime is mounted where /opt/kiln resolves inside the root: ${points.join(" ")}`);
  assert.ok(points.includes(`${k.dataDir}/hostname-target`), "the hostname file is mounted where its symlink resolves inside the root");
  assert.equal(await root(child.id, "cat /srv/landing/mine; ls /srv/landing/kiln >/dev/null && echo agent-here; cat /etc/hostname"), `secret-parent\nagent-here\n${child.id.replaceAll("_", "-")}\n`);
  assert.deepEqual(foreignMounts(), outside, "no mount appeared on the host outside the data dir");
  assert.ok(!existsSync("/srv/landing"), "nothing was made on the host's own /srv");
  // The host's mounts of the child are its rootfs and disk only: nothing the swap placed inside it propagated out.
  const ofChild = hostMounts().filter((m) => m.includes(child.id));
  assert.deepEqual(ofChild.map((m) => m.slice(join(k.dataDir, "machines", child.id).length)).sort(), ["/disk/mnt", "/rootfs"]);
  assert.ok(!existsSync(join(k.dataDir, "hostname-target")), "nothing was made at the host path the symlink names");
  await destroyAll([child.id, parent.id]);
});

/**
 * Asserts nothing of machine `id` is on the host but its own rootfs and disk while it runs — and, `swapped`, the old
 * disk its first processes still hold (docs/snapshots.md) — and nothing once it is gone.
 */
function assertNoLeftovers(id: string, outside: string[], state: "swapped" | "booted" | "gone"): void {
  assert.deepEqual(foreignMounts(), outside, "no mount appeared on the host outside the data dir");
  assert.ok(!hostMounts().some((m) => m.includes(".kiln-root")), "the helper's stage is not mounted on the host");
  const ofChild = hostMounts().filter((m) => m.includes(id));
  assert.deepEqual(ofChild.map((m) => m.slice(join(k.dataDir, "machines", id).length)).sort(), state === "gone" ? [] : ["/disk/mnt", "/rootfs"]);
  const loops = execFileSync("losetup", ["-a"], { encoding: "utf8" }).split("\n").filter((l) => l.includes(id));
  const kept = state === "gone" ? loops : loops.filter((l) => l.includes("(deleted)"));
  assert.ok(kept.length <= (state === "swapped" ? 1 : 0), `no other disk of ${id} stays attached: ${loops.join("; ")}`);
}

/** Deletes machines, then waits (bounded) for their disks to leave the loop devices. */
async function destroyAll(ids: string[]): Promise<void> {
  for (const id of ids) assert.equal((await k.call("DELETE", `/v1/machines/${id}`)).status, 200);
  const attached = () => execFileSync("losetup", ["-a"], { encoding: "utf8" }).split("\n").filter((l) => ids.some((id) => l.includes(id)));
  for (let i = 0; i < 200 && attached().length; i++) await new Promise((r) => setTimeout(r, 25));
  for (const id of ids) assertNoLeftovers(id, foreignMounts(), "gone");
}

test("a mount point the swap cannot place: the child boots from the snapshot instead, nothing of the attempt left", { skip: !RUNC && "the swap is runc's" }, async () => {
  const parent = await createMachine(k, {});
  await root(parent.id, "echo from-parent > /workspace/f");
  // The helper makes a missing mount point only one level deep; the swap fails after placing /proc, /dev and /sys.
  craft(parent.id, "ln -s /nonexistent/deep/x opt && chown -h 100000:100000 opt");
  const outside = foreignMounts();
  const failed = swapFailures().length;
  const child = await fork(parent.id);
  assert.equal(swapFailures().length, failed + 1, "the swap failed");
  assert.match(swapFailures().at(-1)!, /kiln-idmount: open \/opt\/kiln: No such file or directory/);
  assert.equal(await root(child.id, "cat /workspace/f"), "from-parent\n");
  assertNoLeftovers(child.id, outside, "booted");
  await destroyAll([child.id, parent.id]);
});

test("a mount point through /proc's magic links is refused by the swap; nothing of it is left", { skip: !RUNC && "the swap is runc's" }, async () => {
  const parent = await createMachine(k, {});
  // Resolved on the host, /proc/1/root would be the host's root.
  craft(parent.id, "ln -s /proc/1/root opt && chown -h 100000:100000 opt");
  const outside = foreignMounts();
  const failed = swapFailures().length;
  const [warm] = await warmReady();
  const f = await k.call("POST", `/v1/machines/${parent.id}/fork`, { body: { count: 1 } });
  assert.equal(swapFailures().length, failed + 1, "the swap failed");
  assert.match(swapFailures().at(-1)!, /open in the new root \/opt\/kiln: Too many levels of symbolic links/);
  // Booted from the snapshot instead, runc resolves the link inside the machine (which then cannot run its agent
  // from there): the fork fails as a failed boot, with nothing of the warm machine or the boot left on the host.
  assert.equal(f.status, 500, f.text);
  assert.match(f.body.error, /failed to start/);
  assertNoLeftovers(warm!, outside, "gone");
  await destroyAll([parent.id]);
});

test("a warm machine whose recorded first process is now another machine's: the swap refuses it, that machine keeps its root", { skip: !RUNC && "the swap is runc's" }, async () => {
  // As after the warm machine's first process ended and its pid went to a process of another machine (the parent):
  // the helper must not pivot that machine's processes onto the copy.
  const parent = await createMachine(k, {});
  await root(parent.id, "echo mine > /workspace/own");
  const [warm] = await warmReady();
  const pidOf = (id: string) => readFileSync(join(k.dataDir, "machines", id, "runtime.pid"), "utf8");
  const parentPid = pidOf(parent.id);
  const rootOf = (pid: string) => statSync(`/proc/${pid}/root`);
  const before = rootOf(parentPid);
  writeFileSync(join(k.dataDir, "machines", warm!, "runtime.pid"), parentPid);
  const failed = swapFailures().length;
  const f = await k.call("POST", `/v1/machines/${parent.id}/fork`, { body: { count: 1 } });
  assert.equal(swapFailures().length, failed + 1, "the swap was refused");
  assert.match(swapFailures().at(-1)!, /is not the machine's/);
  const after = rootOf(parentPid);
  assert.deepEqual([after.dev, after.ino], [before.dev, before.ino], "the parent's processes still run on their own root");
  assert.equal(await root(parent.id, "cat /workspace/own; echo later > /workspace/later; cat /workspace/later"), "mine\nlater\n");
  if (f.status === 201) assert.equal(await root(f.body.machines[0].id, "cat /workspace/own; cat /workspace/later 2>/dev/null || echo none"), "mine\nnone\n");
  await destroyAll([...(f.status === 201 ? [f.body.machines[0].id] : []), parent.id]);
});

test("a swapped child forks again: the grandchild has the child's files on its own uid range, and nothing is left", { skip: !RUNC && "the swap is runc's" }, async () => {
  const parent = await createMachine(k, {});
  await root(parent.id, "echo gen0 > /workspace/g");
  const child = await fork(parent.id);
  await root(child.id, "echo gen1 >> /workspace/g");
  const grand = await fork(child.id);
  assert.equal(await root(grand.id, "cat /workspace/g"), "gen0\ngen1\n");
  // Each on the host ids of its own range: the warm machine's, never its parent's.
  const ranges = await Promise.all([parent, child, grand].map((m) => root(m.id, "cat /proc/self/uid_map")));
  assert.equal(new Set(ranges).size, 3, `three machines, three uid ranges: ${ranges.join(" | ")}`);
  const outside = foreignMounts();
  assertNoLeftovers(grand.id, outside, "swapped");
  await destroyAll([grand.id, child.id, parent.id]);
});
