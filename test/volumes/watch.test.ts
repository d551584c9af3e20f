// GET /v1/volumes/{id}/ws with real sockets: refusals before the upgrade, file_event frames for API writes and for
// writes made in a machine (mkdir -p under a recursive watch), the frame refusals, several watches and unwatch,
// resync_required on a slow client and on a watcher restart (the socket stays usable), a deleted volume, keepalive.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { execFileSync } from "node:child_process";
import { join } from "node:path";
import { WebSocket } from "ws";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { collectFrames } from "../support/frames.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_WS_PING_INTERVAL_MS: "200" } });
});
after(async () => k?.close());

function connect(server: TestKiln, id: string, opts: { key?: string; autoPong?: boolean } = {}) {
  const ws = new WebSocket(`${server.url.replace("http", "ws")}/v1/volumes/${id}/ws`, {
    headers: { authorization: `Bearer ${opts.key ?? TEST_KEY}` },
    autoPong: opts.autoPong ?? true,
  });
  const opened = new Promise<void>((resolve, reject) => {
    ws.once("open", () => resolve());
    ws.once("error", reject);
  });
  const closed = new Promise<number>((resolve) => ws.once("close", (code) => resolve(code)));
  return { ws, opened, closed, ...collectFrames(ws) };
}

async function createVolume(server: TestKiln, name: string) {
  const res = await server.call("POST", "/v1/volumes", { body: { name, size_mb: 16 } });
  assert.equal(res.status, 201, res.text);
  return res.body;
}

async function watch(c: ReturnType<typeof connect>, path: string, recursive?: boolean, request_id = `r-${path}`) {
  c.send({ type: "file_watch", request_id, path, ...(recursive === undefined ? {} : { recursive }) });
  const f = await c.next((x) => x.request_id === request_id);
  assert.equal(f.type, "file_watch.started", JSON.stringify(f));
  return f.watch_id as string;
}

function put(server: TestKiln, volumeId: string, path: string, data: string) {
  return server.call("PUT", `/v1/volumes/${volumeId}/files?path=${encodeURIComponent(path)}`, { raw: data, headers: { "content-type": "application/octet-stream" } });
}

const event = (watchId: string, kind: string, path: string) => (f: any) => f.type === "file_event" && f.watch_id === watchId && f.event === kind && f.path === path;

test("refusals before the upgrade: no key 401, unknown volume 404, as HTTP envelopes", async () => {
  const v = await createVolume(k, "refusals");
  for (const [id, key, status] of [[v.id, "kiln_wrong_000000000000000000000000000", 401], ["vol_00000000000000000000000000", TEST_KEY, 404]] as const) {
    const c = connect(k, id, { key });
    const res = await new Promise<{ status: number; body: string }>((resolve) => {
      c.ws.on("unexpected-response", (_req, r) => {
        let body = "";
        r.on("data", (d) => (body += d));
        r.on("end", () => resolve({ status: r.statusCode ?? 0, body }));
      });
      c.ws.on("error", () => undefined);
    });
    assert.equal(res.status, status);
    const env = JSON.parse(res.body);
    assert.equal(env.code, status === 401 ? "unauthorized" : "not_found");
    assert.match(env.request_id, /^req_/);
  }
  await k.call("DELETE", `/v1/volumes/${v.id}`);
});

test("file_event frames for API changes, with volume-rooted paths; several watches, each its own scope; file_unwatch", async () => {
  const v = await createVolume(k, "api-events");
  await k.call("POST", `/v1/volumes/${v.id}/files/mkdir`, { body: { path: "/docs" } });
  const c = connect(k, v.id);
  await c.opened;
  const all = await watch(c, "/", true);
  const docs = await watch(c, "/docs", false);
  assert.notEqual(all, docs);

  assert.equal((await put(k, v.id, "/docs/a.txt", "one")).status, 200);
  await c.next(event(all, "create", "/docs/a.txt"));
  const direct = await c.next(event(docs, "create", "/docs/a.txt"));
  assert.equal(direct.is_dir, false);
  await k.call("POST", `/v1/volumes/${v.id}/files/mkdir`, { body: { path: "/docs/sub" } });
  assert.equal((await c.next(event(all, "create", "/docs/sub"))).is_dir, true);
  await put(k, v.id, "/docs/sub/deep.txt", "deep");
  await c.next(event(all, "create", "/docs/sub/deep.txt"));
  await put(k, v.id, "/docs/sub/deep.txt", "deeper");
  await c.next(event(all, "write", "/docs/sub/deep.txt"));
  await k.call("POST", `/v1/volumes/${v.id}/files/move`, { body: { src: "/docs/a.txt", dest: "/docs/b.txt" } });
  await c.next(event(docs, "rename", "/docs/a.txt"));
  await c.next(event(docs, "create", "/docs/b.txt"));
  await k.call("DELETE", `/v1/volumes/${v.id}/files?path=/docs/b.txt`);
  await c.next(event(docs, "remove", "/docs/b.txt"));
  assert.ok(!c.frames.some((f) => f.watch_id === docs && f.path === "/docs/sub/deep.txt"), "a watch that is not recursive sees only direct children");
  assert.ok(!c.frames.concat([]).some((f) => typeof f.path === "string" && f.path.includes(".kiln-upload-")), "uploads in flight are not shown");

  c.send({ type: "file_unwatch", request_id: "u1", watch_id: docs });
  assert.equal((await c.next((f) => f.request_id === "u1")).type, "file_unwatch.done");
  await put(k, v.id, "/docs/c.txt", "c");
  await c.next(event(all, "create", "/docs/c.txt"));
  assert.ok(!c.frames.some((f) => f.watch_id === docs && f.path === "/docs/c.txt"), "an ended watch gets nothing more");
  c.ws.close();
  await c.closed;
  await k.call("DELETE", `/v1/volumes/${v.id}`);
});

test("file_event frames for writes in a machine: mkdir -p a/b/c under a recursive watch, then a write in c", async () => {
  const v = await createVolume(k, "machine-events");
  const m = (await k.call("POST", "/v1/machines", { body: { volumes: [{ volume_id: v.id, path: "/data" }] } })).body;
  const c = connect(k, v.id);
  await c.opened;
  const w = await watch(c, "/", true);
  const res = await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "mkdir -p /data/a/b/c && echo hi > /data/a/b/c/f.txt" } });
  assert.equal(res.body.exit_code, 0, res.text);
  // The write can land before inotify watches c: what c already holds is announced all the same.
  for (const p of ["/a", "/a/b", "/a/b/c"]) assert.equal((await c.next(event(w, "create", p))).is_dir, true, p);
  await c.next(event(w, "create", "/a/b/c/f.txt"));
  await c.next(event(w, "write", "/a/b/c/f.txt"));
  await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "rm -r /data/a/b/c" } });
  await c.next(event(w, "remove", "/a/b/c/f.txt"));
  await c.next(event(w, "remove", "/a/b/c"));
  const creates = c.frames.filter((f) => f.event === "create" && f.path.startsWith("/a"));
  assert.deepEqual(creates, [], "each create is reported once");

  // A second machine's write reaches the same watch (one filesystem).
  const m2 = (await k.call("POST", "/v1/machines", { body: { volumes: [{ volume_id: v.id, path: "/vol" }] } })).body;
  await k.call("POST", `/v1/machines/${m2.id}/exec`, { body: { cmd: "echo x > /vol/from-two && chmod 640 /vol/from-two" } });
  await c.next(event(w, "create", "/from-two"));
  await c.next(event(w, "chmod", "/from-two"));
  for (const id of [m.id, m2.id]) await k.call("DELETE", `/v1/machines/${id}`);
  c.ws.close();
  await k.call("DELETE", `/v1/volumes/${v.id}`);
});

test("frame refusals: relative paths, user-scoped watches, missing paths, bad frames, unknown watches", async () => {
  const v = await createVolume(k, "frame-refusals");
  const c = connect(k, v.id);
  await c.opened;
  const cases: [unknown, string, string][] = [
    [{ type: "file_watch", request_id: "rel", path: "docs" }, "invalid_request", "rel"],
    [{ type: "file_watch", request_id: "usr", path: "/", user: "root" }, "invalid_request", "usr"],
    [{ type: "file_watch", request_id: "nf", path: "/nope" }, "not_found", "nf"],
    [{ type: "file_watch", request_id: "extra", path: "/", colour: 1 }, "invalid_request", "extra"],
    [{ type: "file_watch", request_id: "rec", path: "/", recursive: "yes" }, "invalid_request", "rec"],
    [{ type: "exec.start", request_id: "other", cmd: "ls" }, "invalid_request", "other"],
    [{ type: "file_unwatch", request_id: "unk", watch_id: "w999" }, "not_found", "unk"],
  ];
  for (const [frame, code, rid] of cases) {
    c.send(frame);
    const f = await c.next((x) => x.request_id === rid);
    assert.equal(f.type, "error", rid);
    assert.equal(f.code, code, rid);
    assert.ok(f.error.length > 0);
  }
  c.send("not json");
  assert.equal((await c.next((x) => x.type === "error" && !x.request_id)).code, "invalid_request");
  // The socket is still usable after every refusal.
  const w = await watch(c, "/", true);
  await put(k, v.id, "/ok", "ok");
  await c.next(event(w, "create", "/ok"));
  c.ws.close();
  await k.call("DELETE", `/v1/volumes/${v.id}`);
});

test("a client too slow for its bounded queue gets resync_required; the watch and the socket stay usable", async () => {
  const tiny = await startTestKiln({ waitForBase: false, env: { KILN_WARM_POOL: "0", KILN_VOLUME_WATCH_QUEUE: "2" } });
  try {
    const v = await createVolume(tiny, "tiny-queue");
    const c = connect(tiny, v.id);
    await c.opened;
    const w = await watch(c, "/", true);
    // A burst written straight into the host mount, faster than a 2-frame queue drains.
    const mount = join(tiny.dataDir, "volumes", v.id, "mnt");
    for (let i = 0; i < 300; i++) writeFileSync(join(mount, `f${i}`), "x");
    const resync = await c.next((f) => f.type === "resync_required" && f.watch_id === w);
    assert.deepEqual(resync, { type: "resync_required", watch_id: w, path: "/", reason: "slow_client" });
    // Quiet again: the next change arrives as an event on the same watch.
    await new Promise((r) => setTimeout(r, 300));
    await put(tiny, v.id, "/after", "a");
    await c.next(event(w, "create", "/after"));
    c.ws.close();
  } finally {
    await tiny.close();
  }
});

test("the watcher is confined to the volume; one that dies is restarted and says resync_required; events flow again", async () => {
  const v = await createVolume(k, "restart");
  const c = connect(k, v.id);
  await c.opened;
  const w = await watch(c, "/", true);
  const plane = await k.kiln.services.volumes.resolveDataPlane(v.id);
  const pid = plane.watcherPid();
  assert.ok(pid);
  // The watcher lives in a root of its own: the volume at /vol and nothing of the host's files to be led to.
  assert.ok(statSync(`/proc/${pid}/root/vol`).isDirectory());
  assert.equal(existsSync(`/proc/${pid}/root/etc/passwd`), false);
  process.kill(pid, "SIGKILL");
  const resync = await c.next((f) => f.type === "resync_required" && f.watch_id === w);
  assert.equal(resync.reason, "watcher_restarted");
  assert.notEqual(plane.watcherPid(), pid);
  await put(k, v.id, "/again", "a");
  await c.next(event(w, "create", "/again"));
  c.ws.close();
  await k.call("DELETE", `/v1/volumes/${v.id}`);
});

test("a deleted volume closes its watches with an error frame, then the socket", async () => {
  const v = await createVolume(k, "doomed");
  const c = connect(k, v.id);
  await c.opened;
  const w = await watch(c, "/", true);
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}`)).status, 204);
  const f = await c.next((x) => x.type === "error");
  assert.equal(f.code, "not_found");
  assert.equal(f.watch_id, w);
  assert.equal(await c.closed, 1001);
});

test("keepalive: a client that answers no pings is closed after two missed pongs", async () => {
  const v = await createVolume(k, "keepalive");
  const c = connect(k, v.id, { autoPong: false });
  await c.opened;
  const started = Date.now();
  await c.closed;
  assert.ok(Date.now() - started >= 400, "not before two intervals");
  const live = connect(k, v.id);
  await live.opened;
  await new Promise((r) => setTimeout(r, 800));
  assert.equal(live.ws.readyState, WebSocket.OPEN, "a client that answers stays");
  live.ws.close();
  await k.call("DELETE", `/v1/volumes/${v.id}`);
});

test("nothing leaks: every volume this server made is gone, with its mount, loop device and watcher", async () => {
  const v = await createVolume(k, "last");
  const c = connect(k, v.id);
  await c.opened;
  await watch(c, "/", true);
  const pid = (await k.kiln.services.volumes.resolveDataPlane(v.id)).watcherPid();
  assert.ok(pid);
  c.ws.close();
  await c.closed;
  assert.equal((await k.call("DELETE", `/v1/volumes/${v.id}`)).status, 204);
  // Bounded: on a loaded host the kernel may still be tearing the killed process down when DELETE answers.
  for (let i = 0; i < 50 && existsSync(`/proc/${pid}`); i++) await new Promise((r) => setTimeout(r, 20));
  assert.equal(existsSync(`/proc/${pid}`), false, "the watcher has exited");
  assert.deepEqual((await k.call("GET", "/v1/volumes")).body.volumes, []);
  // Machines' own disks (and the spare ones) are loop devices too: only the volumes' are asked about here.
  assert.equal(execFileSync("losetup", ["-a"], { encoding: "utf8" }).includes(join(k.dataDir, "volumes")), false);
  assert.equal(readFileSync("/proc/self/mountinfo", "utf8").includes(join(k.dataDir, "volumes")), false);
});
