// Volumes shared between machines on runc: the records and their refusals, two machines seeing each other's
// writes, read-only mounts, the size limit, file routes rooted at the volume's /, symlinks never followed out of
// the volume (final and intermediate components, and a machine racing the API), restart, and no leaked mounts.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

async function createVolume(body: Record<string, unknown>) {
  const res = await k.call("POST", "/v1/volumes", { body });
  assert.equal(res.status, 201, res.text);
  return res.body;
}

async function machine(volumes: unknown[]) {
  const res = await k.call("POST", "/v1/machines", { body: { volumes } });
  assert.equal(res.status, 201, res.text);
  return res.body;
}

async function sh(id: string, cmd: string, user?: string) {
  const res = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd, ...(user ? { user } : {}) } });
  assert.equal(res.status, 200, res.text);
  return res.body as { exit_code: number; stdout: string; stderr: string };
}

function put(volumeId: string, path: string, data: string) {
  return k.call("PUT", `/v1/volumes/${volumeId}/files?path=${encodeURIComponent(path)}`, { raw: data, headers: { "content-type": "application/octet-stream" } });
}

function get(volumeId: string, path: string) {
  return k.call("GET", `/v1/volumes/${volumeId}/files?path=${encodeURIComponent(path)}`);
}

function hostHolds(dataDir: string): { loops: string[]; mounts: string[] } {
  const loops = execFileSync("losetup", ["-a"], { encoding: "utf8" })
    .split("\n")
    .filter((l) => l.includes(join(dataDir, "volumes"))); // machines' own disks are loop devices too
  const mounts = readFileSync("/proc/self/mountinfo", "utf8")
    .split("\n")
    .filter((l) => l.includes(join(dataDir, "volumes")));
  return { loops, mounts };
}

/**
 * Waits (bounded) until nothing of the data dir's volumes is held. A loop device whose last user was a destroyed
 * machine's mount namespace is released by the kernel once that namespace is gone, a moment after the destroy.
 */
async function settledHostHolds(dataDir: string): Promise<{ loops: string[]; mounts: string[] }> {
  let held = hostHolds(dataDir);
  for (let i = 0; i < 100 && (held.loops.length || held.mounts.length); i++) {
    await new Promise((r) => setTimeout(r, 100));
    held = hostHolds(dataDir);
  }
  return held;
}

test("a volume is created, fetched and listed page by page; bad input is refused and changes nothing", async () => {
  const a = await createVolume({ name: "alpha", size_mb: 32 });
  assert.match(a.id, /^vol_/);
  assert.equal(a.size_mb, 32);
  assert.equal(a.status, "ready");
  const b = await createVolume({ name: "beta" });
  assert.equal(b.size_mb, 1024, "the default size");
  assert.deepEqual((await k.call("GET", `/v1/volumes/${a.id}`)).body, a);

  const first = await k.call("GET", "/v1/volumes?limit=1");
  assert.deepEqual(first.body.volumes.map((v: any) => v.id), [b.id], "newest first");
  assert.ok(first.body.next_cursor);
  const second = await k.call("GET", `/v1/volumes?limit=1&cursor=${first.body.next_cursor}`);
  assert.deepEqual(second.body.volumes.map((v: any) => v.id), [a.id]);
  assert.equal(second.body.next_cursor, null);

  for (const [body, why] of [
    [{ name: "x", size_mb: 1 }, "size below the minimum"],
    [{ name: "x", size_mb: 10_000_000 }, "size above the maximum"],
    [{ name: "" }, "empty name"],
    [{ name: "x", colour: "red" }, "unknown field"],
    [{ size_mb: 32 }, "no name"],
  ] as const) {
    const res = await k.call("POST", "/v1/volumes", { body });
    assert.equal(res.status, 400, why);
    assert.equal(res.body.code, "invalid_request", why);
  }
  assert.equal((await k.call("GET", "/v1/volumes")).body.volumes.length, 2, "the refusals made nothing");
  assert.equal((await k.call("GET", "/v1/volumes/vol_00000000000000000000000000")).body.code, "not_found");
  assert.equal((await k.call("GET", "/v1/volumes?cursor=bogus")).status, 400);
  assert.equal((await k.call("DELETE", `/v1/volumes/${b.id}`)).status, 204);
  assert.equal((await k.call("GET", `/v1/volumes/${b.id}`)).status, 404);
  assert.equal((await k.call("DELETE", `/v1/volumes/${a.id}`)).status, 204);
  assert.deepEqual(await settledHostHolds(k.dataDir), { loops: [], mounts: [] }, "deleted volumes leave no mount and no loop device");
});

test("two machines sharing a volume see each other's writes at once; a read_only mount refuses writes", async () => {
  const v = await createVolume({ name: "shared", size_mb: 64 });
  const [m1, m2, ro] = await Promise.all([
    machine([{ volume_id: v.id, path: "/data" }]),
    machine([{ volume_id: v.id, path: "/mnt/shared" }]),
    machine([{ volume_id: v.id, path: "/data", read_only: true }]),
  ]);
  const w = await sh(m1.id, "echo from-one > /data/hello.txt && stat -c %U /data/hello.txt && stat -c %U /data");
  assert.equal(w.exit_code, 0, w.stderr);
  assert.equal(w.stdout, "user\nuser\n", "the machines' user owns the volume and what it writes there, without sudo");
  assert.equal((await sh(m2.id, "cat /mnt/shared/hello.txt")).stdout, "from-one\n");
  assert.equal((await sh(m2.id, "echo from-two >> /mnt/shared/hello.txt")).exit_code, 0);
  assert.equal((await sh(m1.id, "cat /data/hello.txt")).stdout, "from-one\nfrom-two\n");
  assert.equal((await sh(ro.id, "cat /data/hello.txt")).stdout, "from-one\nfrom-two\n");
  const refused = await sh(ro.id, "echo nope > /data/nope.txt", "root");
  assert.notEqual(refused.exit_code, 0);
  assert.match(refused.stderr, /Read-only file system/);

  // The API sees the same files, paths rooted at the volume's /.
  assert.equal((await get(v.id, "/hello.txt")).text, "from-one\nfrom-two\n");
  const info = (await k.call("POST", `/v1/volumes/${v.id}/files/info`, { body: { path: "/hello.txt" } })).body;
  assert.equal(info.path, "/hello.txt");
  assert.equal(info.owner, "user");
  assert.equal(info.type, "file");

  // DELETE while live machines mount it: 409, and they are named.
  const busy = await k.call("DELETE", `/v1/volumes/${v.id}`);
  assert.equal(busy.status, 409);
  assert.equal(busy.body.code, "conflict");
  assert.deepEqual(new Set(busy.body.error_detail.details.machine_ids), new Set([m1.id, m2.id, ro.id]));
  assert.equal((await get(v.id, "/hello.txt")).status, 200, "the refused delete changed nothing");
  for (const m of [m1, m2]) await k.call("DELETE", `/v1/machines/${m.id}`);
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}`)).status, 409, "the read-only machine, still running, holds it");
  await k.call("DELETE", `/v1/machines/${ro.id}`);
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}`)).status, 204);
});

test("a machine's volumes are refused when the volume is unknown or the mount point is the platform's", async () => {
  const v = await createVolume({ name: "refusals", size_mb: 16 });
  for (const [volumes, why] of [
    [[{ volume_id: "vol_00000000000000000000000000", path: "/data" }], "unknown volume"],
    [[{ volume_id: v.id, path: "data" }], "relative mount point"],
    [[{ volume_id: v.id, path: "/proc/x" }], "over /proc"],
    [[{ volume_id: v.id, path: "/opt/kiln" }], "over the guest runtime"],
    [[{ volume_id: v.id, path: "/" }], "at /"],
    [[{ volume_id: v.id, path: "/a" }, { volume_id: v.id, path: "/a/" }], "twice at one path"],
    [[{ volume_id: v.id, path: "/a", extra: 1 }], "unknown field"],
  ] as const) {
    const res = await k.call("POST", "/v1/machines", { body: { volumes } });
    assert.equal(res.status, 400, `${why}: ${res.text}`);
    assert.equal(res.body.code, "invalid_request");
  }
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}`)).status, 204, "refused machines hold nothing");
});

test("file routes: write, read, list, info, mkdir, move, delete, every path rooted at the volume's /", async () => {
  const v = await createVolume({ name: "files", size_mb: 16 });
  const w = await put(v.id, "/docs/a/readme.md", "# hello");
  assert.equal(w.status, 200, w.text);
  assert.equal(w.body.path, "/docs/a/readme.md");
  assert.equal(w.body.owner, "user");
  assert.equal(w.body.permissions, "0644");
  assert.equal((await get(v.id, "/docs/a/readme.md")).text, "# hello");
  assert.equal((await get(v.id, "/docs/./a/../a/readme.md")).text, "# hello", "paths are normalised");

  const mk = await k.call("POST", `/v1/volumes/${v.id}/files/mkdir`, { body: { path: "/x/y/z", mode: "0700" } });
  assert.equal(mk.status, 200);
  assert.equal(mk.body.type, "directory");
  assert.equal(mk.body.permissions, "0700");
  const list = await k.call("GET", `/v1/volumes/${v.id}/files/list?path=/&depth=3`);
  assert.deepEqual(list.body.entries.map((e: any) => e.path), ["/docs", "/docs/a", "/docs/a/readme.md", "/x", "/x/y", "/x/y/z"]);
  const root = (await k.call("POST", `/v1/volumes/${v.id}/files/info`, { body: { path: "/" } })).body;
  assert.equal(root.path, "/");
  assert.equal(root.type, "directory");
  assert.equal(root.owner, "user");
  assert.match(root.mode, /^40/);

  const mv = await k.call("POST", `/v1/volumes/${v.id}/files/move`, { body: { src: "/docs/a/readme.md", dest: "/x/readme.md" } });
  assert.equal(mv.status, 200, mv.text);
  assert.equal(mv.body.path, "/x/readme.md");
  assert.equal((await get(v.id, "/docs/a/readme.md")).status, 404);
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}/files?path=/x`)).status, 400, "a non-empty directory needs recursive");
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}/files?path=/x&recursive=true`)).status, 204);
  assert.equal((await get(v.id, "/x/readme.md")).status, 404);

  // `..` never leaves the volume: /../../etc/passwd is the volume's /etc/passwd, which does not exist.
  const escape = await get(v.id, "/../../../etc/passwd");
  assert.equal(escape.status, 404);
  assert.doesNotMatch(escape.text, /root:/);
  for (const [method, path, why] of [
    ["GET", `/v1/volumes/${v.id}/files?path=docs`, "relative path"],
    ["GET", `/v1/volumes/${v.id}/files?path=/docs&user=root`, "a user"],
    ["GET", `/v1/volumes/${v.id}/files?path=/docs`, "a directory read as a file"],
    ["DELETE", `/v1/volumes/${v.id}/files?path=/`, "removing the root"],
  ] as const) {
    const res = await k.call(method, path);
    assert.equal(res.status, 400, `${why}: ${res.text}`);
    assert.equal(res.body.code, "invalid_request");
  }
  assert.equal((await k.call("POST", `/v1/volumes/${v.id}/files/info`, { body: { path: "/nope" } })).status, 404);
  assert.equal((await k.call("POST", "/v1/volumes/vol_00000000000000000000000000/files/info", { body: { path: "/" } })).status, 404);
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}`)).status, 204);
});

test("a symlink made in a machine is reported as a symlink and never followed out of the volume", async () => {
  const v = await createVolume({ name: "links", size_mb: 16 });
  const m = await machine([{ volume_id: v.id, path: "/data" }]);
  const made = await sh(m.id, "ln -s /etc/passwd /data/pw && ln -s /etc /data/etc && ln -s / /data/root && echo ok", "root");
  assert.equal(made.stdout, "ok\n", made.stderr);
  // A FIFO, made from the host side (gVisor keeps FIFOs made inside a machine to itself).
  execFileSync("mkfifo", [join(k.dataDir, "volumes", v.id, "mnt", "fifo")]);
  const hostPasswd = readFileSync("/etc/passwd", "utf8");

  const info = (await k.call("POST", `/v1/volumes/${v.id}/files/info`, { body: { path: "/pw" } })).body;
  assert.equal(info.type, "symlink");
  assert.equal(info.symlink_target, "/etc/passwd");
  assert.match(info.mode, /^120/);
  const listed = (await k.call("GET", `/v1/volumes/${v.id}/files/list?path=/&depth=3`)).body.entries;
  assert.deepEqual(listed.map((e: any) => [e.path, e.type]), [["/etc", "symlink"], ["/fifo", "file"], ["/pw", "symlink"], ["/root", "symlink"]], "links are listed, not descended");

  // Final component: a symlink is not read through; intermediate component: a path through a link is refused.
  for (const path of ["/pw", "/etc/passwd", "/root/etc/passwd", "/fifo"]) {
    const res = await get(v.id, path);
    assert.equal(res.status, 400, `${path}: ${res.text}`);
    assert.doesNotMatch(res.text, /root:x:0:0/);
  }
  assert.equal((await k.call("GET", `/v1/volumes/${v.id}/files/list?path=/etc`)).status, 400);
  assert.equal((await k.call("POST", `/v1/volumes/${v.id}/files/info`, { body: { path: "/etc/passwd" } })).status, 400);
  assert.equal((await put(v.id, "/etc/kiln-escape", "x")).status, 400);
  assert.equal((await k.call("POST", `/v1/volumes/${v.id}/files/mkdir`, { body: { path: "/root/tmp/kiln-escape" } })).status, 400);
  assert.equal((await k.call("POST", `/v1/volumes/${v.id}/files/move`, { body: { src: "/etc/hostname", dest: "/stolen" } })).status, 400);
  assert.throws(() => statSync("/etc/kiln-escape"));
  assert.throws(() => statSync("/tmp/kiln-escape"));
  // Writing over a link replaces the link; removing one removes the link: the host's files never change.
  assert.equal((await put(v.id, "/pw", "mine")).body.type, "file");
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}/files?path=/etc&recursive=true`)).status, 204);
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}/files?path=/root&recursive=true`)).status, 204);
  assert.equal(readFileSync("/etc/passwd", "utf8"), hostPasswd);
  assert.ok(statSync("/etc/hostname").isFile());

  // A machine swapping a directory for a symlink to /etc as fast as it can, while the API reads through it.
  const racer = sh(m.id, "timeout 6 sh -c 'while :; do rm -rf /data/swap; mkdir /data/swap; echo inside > /data/swap/passwd; rm -rf /data/swap; ln -s /etc /data/swap; done'", "root");
  const seen = new Set<string>();
  for (let i = 0; i < 300; i++) {
    const res = await get(v.id, "/swap/passwd");
    assert.doesNotMatch(res.text, /root:x:0:0/, "the host's /etc/passwd never comes back");
    seen.add(res.status === 200 ? res.text : String(res.status));
    const del = await k.call("DELETE", `/v1/volumes/${v.id}/files?path=/swap/passwd`);
    assert.ok([204, 400, 404].includes(del.status), del.text);
  }
  await racer;
  assert.equal(readFileSync("/etc/passwd", "utf8"), hostPasswd, "nor was it removed");
  assert.ok(seen.size >= 1);
  await k.call("DELETE", `/v1/machines/${m.id}`);
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}`)).status, 204);
});

test("the size limit: a write past size_mb fails with ENOSPC inside the machine; the host and other volumes are fine", async () => {
  const small = await createVolume({ name: "small", size_mb: 16 });
  const other = await createVolume({ name: "other", size_mb: 16 });
  const m = await machine([
    { volume_id: small.id, path: "/small" },
    { volume_id: other.id, path: "/other" },
  ]);
  const dd = await sh(m.id, "dd if=/dev/zero of=/small/big bs=1M count=64 2>&1; echo exit=$?");
  assert.match(dd.stdout, /No space left on device/);
  assert.match(dd.stdout, /exit=1/);
  const image = statSync(join(k.dataDir, "volumes", small.id, "image.ext4"));
  assert.ok(image.blocks * 512 <= 17 * 1024 * 1024, `the image holds at most its size (${image.blocks * 512} bytes on disk)`);
  assert.equal((await sh(m.id, "echo fine > /other/ok && cat /other/ok")).stdout, "fine\n", "another volume is unaffected");
  const full = await put(small.id, "/more.bin", "x".repeat(1024 * 1024));
  assert.equal(full.status, 413, full.text);
  assert.equal(full.body.error_detail.details.reason, "volume_full");
  assert.equal((await sh(m.id, "rm /small/big && echo again > /small/f && cat /small/f")).stdout, "again\n", "freeing space makes it writable again");
  await k.call("DELETE", `/v1/machines/${m.id}`);
  for (const v of [small, other]) assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}`)).status, 204);
});

test("a server restart keeps volumes and their mounts usable, and deleting them afterwards leaks nothing", async () => {
  const v = await createVolume({ name: "durable", size_mb: 16 });
  const m = await machine([{ volume_id: v.id, path: "/data" }]);
  assert.equal((await sh(m.id, "echo before > /data/f")).exit_code, 0);
  await k.stop();
  // The host mount gone while the machine still holds the filesystem (a host reboot would take both): the next
  // start mounts the loop device the machine uses, never a second one over the same image.
  const mnt = join(k.dataDir, "volumes", v.id, "mnt");
  execFileSync("umount", [mnt]);
  const ofVolume = (lines: string[]) => lines.filter((l) => l.includes(v.id)).length;
  const loopsBefore = ofVolume(hostHolds(k.dataDir).loops);
  k = await startTestKiln({ dataDir: k.dataDir, env: { KILN_WARM_POOL: "0" } });
  assert.equal(ofVolume(hostHolds(k.dataDir).mounts), 1, "mounted again at start");
  assert.equal(ofVolume(hostHolds(k.dataDir).loops), loopsBefore, "no second loop device over the image");
  assert.equal((await k.call("GET", `/v1/volumes/${v.id}`)).body.status, "ready");
  assert.equal((await get(v.id, "/f")).text, "before\n");
  assert.equal((await put(v.id, "/g", "after")).status, 200);
  assert.equal((await sh(m.id, "cat /data/g")).stdout, "after", "the adopted machine sees the same filesystem");
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}`)).status, 409);
  await k.call("DELETE", `/v1/machines/${m.id}`);
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}`)).status, 204);
  assert.deepEqual(await settledHostHolds(k.dataDir), { loops: [], mounts: [] });
});
