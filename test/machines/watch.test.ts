// File watches on machine paths over the machine WebSocket: the guest agent watches inside the machine, so writes
// made by the machine's own processes (through its overlay root) and through the files API both show up.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { WebSocket } from "ws";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { collectFrames } from "../support/frames.ts";

let k: TestKiln;
let m: any;
before(async () => {
  k = await startTestKiln();
  m = (await k.call("POST", "/v1/machines", { body: {} })).body;
});
after(async () => k?.close());

async function connect() {
  const ws = new WebSocket(`${k.url.replace("http", "ws")}/v1/machines/${m.id}/ws`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  const reader = collectFrames(ws);
  await new Promise<void>((resolve, reject) => {
    ws.once("open", () => resolve());
    ws.once("error", reject);
  });
  return { ws, ...reader };
}

async function run(c: Awaited<ReturnType<typeof connect>>, cmd: string) {
  const request_id = `run-${Math.random()}`;
  c.send({ type: "exec.start", request_id, cmd });
  const s = await c.next((f) => f.type === "exec.started" && f.request_id === request_id);
  const exit = await c.next((f) => f.type === "exec.exit" && f.pid === s.pid);
  assert.equal(exit.exit_code, 0, `${cmd} failed`);
}

test("file watch: a recursive watch sees create, write, chmod and remove made inside the machine, nested too", async () => {
  const c = await connect();
  await run(c, "mkdir -p /workspace/w/sub");
  c.send({ type: "file_watch", request_id: "w1", path: "w", recursive: true });
  const started = await c.next((f) => f.type === "file_watch.started" && f.request_id === "w1");
  assert.equal(started.path, "/workspace/w");
  assert.match(started.watch_id, /^wch_/);
  const id = started.watch_id;
  const seen: any[] = [];
  c.ws.on("message", (d) => seen.push(JSON.parse(d.toString())));
  const ev = (event: string, path: string) => c.next((f) => f.type === "file_event" && f.watch_id === id && f.event === event && f.path === path).catch((err) => {
    throw new Error(`${event} ${path}: ${err.message}; all: ${JSON.stringify(seen.filter((f) => f.type === "file_event"))}`);
  });

  await run(c, "echo hi > /workspace/w/a.txt");
  assert.equal((await ev("create", "/workspace/w/a.txt")).is_dir, false);
  await ev("write", "/workspace/w/a.txt");
  await run(c, "echo deep > /workspace/w/sub/b.txt");
  await ev("create", "/workspace/w/sub/b.txt");
  await run(c, "chmod 600 /workspace/w/a.txt");
  await ev("chmod", "/workspace/w/a.txt");
  await run(c, "mkdir /workspace/w/newdir");
  assert.equal((await ev("create", "/workspace/w/newdir")).is_dir, true);
  await run(c, "rm /workspace/w/sub/b.txt");
  await ev("remove", "/workspace/w/sub/b.txt");

  // A write through the files API (the agent, inside the machine) is seen as well.
  const put = await k.call("PUT", `/v1/machines/${m.id}/files?path=/workspace/w/api.txt`, { raw: "from api", headers: { "content-type": "application/octet-stream" } });
  assert.ok(put.status < 300, JSON.stringify(put.body));
  await ev("create", "/workspace/w/api.txt");
  await ev("write", "/workspace/w/api.txt");
  // Kiln's upload temp file is never shown, and replacing a file is a write, not a create.
  const again = await k.call("PUT", `/v1/machines/${m.id}/files?path=/workspace/w/api.txt`, { raw: "again", headers: { "content-type": "application/octet-stream" } });
  assert.ok(again.status < 300);
  await ev("write", "/workspace/w/api.txt");
  assert.ok(!seen.some((f) => f.type === "file_event" && f.path.includes(".kiln-upload-")), "upload temp files are hidden");
  assert.equal(seen.filter((f) => f.type === "file_event" && f.path === "/workspace/w/api.txt" && f.event === "create").length, 1);

  c.send({ type: "file_unwatch", request_id: "u1", watch_id: id });
  await c.next((f) => f.type === "file_unwatch.done" && f.watch_id === id);
  await run(c, "echo after > /workspace/w/after.txt");
  assert.ok(!c.frames.some((f) => f.type === "file_event" && f.path === "/workspace/w/after.txt"), "no events after unwatch");
  c.ws.close();
});

test("file watch: a non-recursive watch reports direct children only", async () => {
  const c = await connect();
  await run(c, "mkdir -p /workspace/flat/inner");
  c.send({ type: "file_watch", request_id: "f", path: "/workspace/flat" });
  const { watch_id } = await c.next((f) => f.type === "file_watch.started" && f.request_id === "f");
  await run(c, "echo x > /workspace/flat/inner/deep.txt; echo y > /workspace/flat/top.txt");
  await c.next((f) => f.type === "file_event" && f.watch_id === watch_id && f.path === "/workspace/flat/top.txt");
  assert.ok(!c.frames.some((f) => f.type === "file_event" && f.path === "/workspace/flat/inner/deep.txt"));
  c.ws.close();
});

test("file watch: bad frames get error frames and change nothing", async () => {
  const c = await connect();
  c.send({ type: "file_watch", request_id: "nf", path: "/no/such/dir" });
  assert.equal((await c.next((f) => f.type === "error" && f.request_id === "nf")).code, "not_found");
  await run(c, "touch /workspace/plain.txt");
  c.send({ type: "file_watch", request_id: "nd", path: "/workspace/plain.txt" });
  assert.equal((await c.next((f) => f.type === "error" && f.request_id === "nd")).code, "invalid_request");
  c.send({ type: "file_watch", request_id: "x", path: "/workspace", bogus: 1 });
  assert.equal((await c.next((f) => f.type === "error" && f.request_id === "x")).code, "invalid_request");
  c.send({ type: "file_unwatch", request_id: "u", watch_id: "wch_nope" });
  assert.equal((await c.next((f) => f.type === "error" && f.request_id === "u")).code, "not_found");
  // The socket still works.
  c.send({ type: "file_watch", request_id: "ok", path: "/workspace" });
  await c.next((f) => f.type === "file_watch.started" && f.request_id === "ok");
  c.ws.close();
});

test("file watch: directories made and removed at once under a recursive watch leave the agent and the watch working", async () => {
  const c = await connect();
  await run(c, "mkdir -p /workspace/churn");
  c.send({ type: "file_watch", request_id: "c", path: "/workspace/churn", recursive: true });
  const { watch_id } = await c.next((f) => f.type === "file_watch.started" && f.request_id === "c");
  await run(c, "for i in $(seq 100); do mkdir -p /workspace/churn/d$i/x/y && rm -rf /workspace/churn/d$i; done");
  await run(c, "mkdir /workspace/churn/stays && echo z > /workspace/churn/stays/f");
  // The file made before the new directory's watch was set is reported from the directory's scan.
  await c.next((f) => f.type === "file_event" && f.watch_id === watch_id && f.path === "/workspace/churn/stays/f", 15_000);
  // A directory's own deletion is reported once, by its parent, never as a child named like itself.
  assert.ok(!c.frames.some((f) => f.type === "file_event" && /\/(d\d+)\/\1$/.test(f.path)), JSON.stringify(c.frames.slice(0, 5)));
  c.ws.close();
});
