// Files of a machine through the API, and every path-resolution rule of POST /v1/machines/{id}/files/info.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

let k: TestKiln;
let m: any; // a machine with no cwd
let withCwd: any; // a machine whose cwd is /srv/app
before(async () => {
  k = await startTestKiln({ env: { KILN_BODY_LIMIT_BYTES: String(1024 * 1024) } });
  m = (await k.call("POST", "/v1/machines", { body: {} })).body;
  withCwd = (await k.call("POST", "/v1/machines", { body: { cwd: "/srv/app" } })).body;
  await sh(withCwd.id, "mkdir -p /srv/app && echo cwd > /srv/app/here.txt", "root");
});
after(async () => k?.close());

async function sh(id: string, cmd: string, user?: string) {
  const res = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd, user } });
  assert.equal(res.status, 200, res.text);
  return res.body;
}

async function put(id: string, path: string, data: Buffer, query = "") {
  const res = await request(`${k.url}/v1/machines/${id}/files?path=${encodeURIComponent(path)}${query}`, {
    method: "PUT",
    headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/octet-stream" },
    body: data,
  });
  return { status: res.statusCode, body: (await res.body.json()) as any };
}

async function get(id: string, path: string) {
  const res = await request(`${k.url}/v1/machines/${id}/files?path=${encodeURIComponent(path)}`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  return { status: res.statusCode, bytes: Buffer.from(await res.body.arrayBuffer()) };
}

const info = (id: string, body: Record<string, unknown>) => k.call("POST", `/v1/machines/${id}/files/info`, { body });

test("binary round trip of all 256 byte values, with ownership and mode", async () => {
  const data = Buffer.from(Array.from({ length: 256 * 4 }, (_, i) => i % 256));
  const w = await put(m.id, "/workspace/bin/all.bytes", data, "&mode=0640");
  assert.equal(w.status, 200, JSON.stringify(w.body));
  assert.equal(w.body.path, "/workspace/bin/all.bytes");
  assert.equal(w.body.size, data.length);
  assert.equal(w.body.permissions, "0640");
  assert.equal(w.body.owner, "user", "written as the machine's user by default");
  const r = await get(m.id, "/workspace/bin/all.bytes");
  assert.equal(r.status, 200);
  assert.ok(r.bytes.equals(data));
  assert.equal((await sh(m.id, "sha256sum < /workspace/bin/all.bytes | cut -c1-16")).stdout.length, 17);
  const asRoot = await put(m.id, "/tmp/root-owned", Buffer.from("x"), "&user=root");
  assert.equal(asRoot.body.owner, "root");
  assert.equal(asRoot.body.group, "root");
});

test("files/info: absolute path, normalised, with the SPEC fields", async () => {
  const res = await info(m.id, { path: "/workspace/../workspace/./bin/all.bytes" });
  assert.equal(res.status, 200, res.text);
  assert.deepEqual(Object.keys(res.body).sort(), ["group", "is_dir", "mode", "modified_time", "name", "owner", "path", "permissions", "size", "type"].sort());
  assert.equal(res.body.path, "/workspace/bin/all.bytes");
  assert.equal(res.body.name, "all.bytes");
  assert.equal(res.body.type, "file");
  assert.equal(res.body.mode, "100640");
  assert.equal(res.body.permissions, "0640");
  assert.equal(res.body.is_dir, false);
  assert.ok(!Number.isNaN(Date.parse(res.body.modified_time)));
});

test("files/info: a directory", async () => {
  const res = await info(m.id, { path: "/workspace" });
  assert.equal(res.body.type, "directory");
  assert.equal(res.body.is_dir, true);
  assert.match(res.body.mode, /^40[0-7]{3}$/);
  assert.equal(res.body.owner, "user");
});

test("files/info: a relative path resolves from /workspace when there is no cwd and no user", async () => {
  const res = await info(m.id, { path: "bin/all.bytes" });
  assert.equal(res.status, 200, res.text);
  assert.equal(res.body.path, "/workspace/bin/all.bytes");
});

test("files/info: a relative path resolves from the user's home when user is given", async () => {
  await sh(m.id, "echo hi > /home/user/notes.txt", "user");
  const res = await info(m.id, { path: "notes.txt", user: "user" });
  assert.equal(res.status, 200, res.text);
  assert.equal(res.body.path, "/home/user/notes.txt");
  const asRoot = await info(m.id, { path: ".", user: "root" });
  assert.equal(asRoot.body.path, "/root");
});

test("files/info: a relative path resolves from the machine cwd when it is set, even with a user", async () => {
  const res = await info(withCwd.id, { path: "here.txt", user: "user" });
  assert.equal(res.status, 200, res.text);
  assert.equal(res.body.path, "/srv/app/here.txt");
});

test("files/info: .. in a relative path is normalised and cannot climb above /", async () => {
  const res = await info(m.id, { path: "../../../../etc/hostname" });
  assert.equal(res.status, 200, res.text);
  assert.equal(res.body.path, "/etc/hostname");
});

test("files/info: symlinks are reported, not followed", async () => {
  await sh(m.id, "ln -sf /workspace/bin/all.bytes /workspace/link && ln -sf /nowhere /workspace/dangling");
  const res = await info(m.id, { path: "/workspace/link" });
  assert.equal(res.body.type, "symlink");
  assert.equal(res.body.symlink_target, "/workspace/bin/all.bytes");
  assert.equal(res.body.mode, "120777");
  assert.equal(res.body.is_dir, false);
  const dangling = await info(m.id, { path: "/workspace/dangling" });
  assert.equal(dangling.status, 200);
  assert.equal(dangling.body.symlink_target, "/nowhere");
});

test("files/info: owner and group come from the machine's own files; unmapped ids are numeric", async () => {
  await sh(m.id, "touch /tmp/odd && chown 4242:4343 /tmp/odd", "root");
  const res = await info(m.id, { path: "/tmp/odd" });
  assert.equal(res.body.owner, "4242");
  assert.equal(res.body.group, "4343");
  await sh(m.id, "echo 'odd:x:4242:4343::/tmp:/bin/sh' >> /etc/passwd", "root");
  assert.equal((await info(m.id, { path: "/tmp/odd" })).body.owner, "odd");
});

test("files/info: unknown user 400, missing path 404, bad body 400", async () => {
  const u = await info(m.id, { path: "x", user: "ghost" });
  assert.equal(u.status, 400);
  assert.equal(u.body.code, "invalid_request");
  const missing = await info(m.id, { path: "/workspace/none" });
  assert.equal(missing.status, 404);
  assert.equal(missing.body.code, "not_found");
  assert.equal((await info(m.id, { path: "" })).status, 400);
  assert.equal((await info(m.id, {})).status, 400);
  assert.equal((await info(m.id, { path: "/x", extra: 1 })).status, 400);
});

test("files/info: a machine that is not running answers 409 machine_not_running", async () => {
  const h = (await k.call("POST", "/v1/machines", { body: {} })).body;
  await k.call("POST", `/v1/machines/${h.id}/hibernate`);
  const res = await info(h.id, { path: "/workspace" });
  assert.equal(res.status, 409);
  assert.equal(res.body.code, "machine_not_running");
  assert.equal((await info("mch_00000000000000000000000000", { path: "/" })).status, 404);
});

test("list, mkdir -p, move, remove", async () => {
  const mk = await k.call("POST", `/v1/machines/${m.id}/files/mkdir`, { body: { path: "/workspace/a/b/c" } });
  assert.equal(mk.status, 200, mk.text);
  assert.equal(mk.body.type, "directory");
  assert.equal(mk.body.owner, "user");
  await put(m.id, "/workspace/a/b/c/f.txt", Buffer.from("f"));
  const l1 = await k.call("GET", `/v1/machines/${m.id}/files/list?path=/workspace/a`);
  assert.deepEqual(l1.body.entries.map((e: any) => e.path), ["/workspace/a/b"]);
  const l3 = await k.call("GET", `/v1/machines/${m.id}/files/list?path=/workspace/a&depth=3`);
  assert.deepEqual(l3.body.entries.map((e: any) => e.path).sort(), ["/workspace/a/b", "/workspace/a/b/c", "/workspace/a/b/c/f.txt"]);
  const mv = await k.call("POST", `/v1/machines/${m.id}/files/move`, { body: { src: "/workspace/a/b/c/f.txt", dest: "/workspace/a/g.txt" } });
  assert.equal(mv.status, 200, mv.text);
  assert.equal(mv.body.path, "/workspace/a/g.txt");
  assert.equal((await k.call("DELETE", `/v1/machines/${m.id}/files?path=/workspace/a`)).status, 400, "a non-empty dir needs recursive");
  assert.equal((await k.call("DELETE", `/v1/machines/${m.id}/files?path=/workspace/a&recursive=true`)).status, 204);
  assert.equal((await info(m.id, { path: "/workspace/a" })).status, 404);
  assert.equal((await get(m.id, "/workspace/none")).status, 404);
});

test("a body over the limit answers 413 and writes nothing", async () => {
  const res = await put(m.id, "/workspace/big.bin", Buffer.alloc(2 * 1024 * 1024, 1));
  assert.equal(res.status, 413);
  assert.equal(res.body.code, "payload_too_large");
  assert.equal((await info(m.id, { path: "/workspace/big.bin" })).status, 404);
});
