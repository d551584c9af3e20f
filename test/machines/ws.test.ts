// GET /v1/machines/{id}/ws with real sockets and real PTYs: exec streams, PTY echo/resize, reconnect with replay,
// the exactly-one rules, refusals before the upgrade, keepalive, and backpressure towards a client that stops reading.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { WebSocket } from "ws";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { collectFrames } from "../support/frames.ts";

let k: TestKiln;
let m: any;
before(async () => {
  k = await startTestKiln({ env: { KILN_WS_PING_INTERVAL_MS: "200" } });
  m = (await k.call("POST", "/v1/machines", { body: {} })).body;
});
after(async () => k?.close());

/** A test client: collects frames, waits for the next one matching a predicate. */
function connect(id = m.id, opts: { key?: string; autoPong?: boolean } = {}) {
  const ws = new WebSocket(`${k.url.replace("http", "ws")}/v1/machines/${id}/ws`, {
    headers: { authorization: `Bearer ${opts.key ?? TEST_KEY}` },
    autoPong: opts.autoPong ?? true,
  });
  const opened = new Promise<void>((resolve, reject) => {
    ws.once("open", () => resolve());
    ws.once("error", reject);
  });
  return { ws, opened, ...collectFrames(ws) };
}

test("refusals before the upgrade: no key 401, unknown machine 404, as HTTP envelopes", async () => {
  for (const [id, key, status] of [[m.id, "kiln_wrong_000000000000000000000000000", 401], ["mch_00000000000000000000000000", TEST_KEY, 404]] as const) {
    const c = connect(id, { key });
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
});

test("exec stream: all 256 byte values round trip through stdin and stdout", async () => {
  const c = connect();
  await c.opened;
  c.send({ type: "exec.start", request_id: "r1", cmd: "cat", stdin: true });
  const started = await c.next((f) => f.type === "exec.started" && f.request_id === "r1");
  assert.ok(started.pid > 0);
  const bytes = Buffer.from(Array.from({ length: 256 }, (_, i) => i));
  c.send({ type: "exec.stdin", pid: started.pid, data_base64: bytes.toString("base64"), eof: true });
  const chunks: Buffer[] = [];
  for (;;) {
    const f = await c.next((x) => (x.type === "exec.stdout" || x.type === "exec.exit") && x.pid === started.pid);
    if (f.type === "exec.exit") {
      assert.equal(f.exit_code, 0);
      break;
    }
    chunks.push(Buffer.from(f.data_base64, "base64"));
  }
  assert.ok(Buffer.concat(chunks).equals(bytes));
  c.ws.close();
});

test("exec stream: runs as the machine's user in /workspace unless the frame says otherwise", async () => {
  const c = connect();
  await c.opened;
  c.send({ type: "exec.start", request_id: "who", cmd: "id -un; pwd" });
  const s = await c.next((f) => f.type === "exec.started" && f.request_id === "who");
  let out = "";
  for (;;) {
    const f = await c.next((x) => (x.type === "exec.stdout" || x.type === "exec.exit") && x.pid === s.pid);
    if (f.type === "exec.exit") break;
    out += Buffer.from(f.data_base64, "base64").toString();
  }
  assert.equal(out, "user\n/workspace\n");
  c.ws.close();
});

test("exec stream: stderr apart from stdout, exit code, signals, two processes on one socket", async () => {
  const c = connect();
  await c.opened;
  c.send({ type: "exec.start", request_id: "a", cmd: "echo out; echo err >&2; exit 3" });
  c.send({ type: "exec.start", request_id: "b", cmd: "sleep", args: ["30"] });
  const a = await c.next((f) => f.type === "exec.started" && f.request_id === "a");
  const b = await c.next((f) => f.type === "exec.started" && f.request_id === "b");
  assert.notEqual(a.pid, b.pid);
  const err = await c.next((f) => f.type === "exec.stderr" && f.pid === a.pid);
  assert.equal(Buffer.from(err.data_base64, "base64").toString(), "err\n");
  assert.equal((await c.next((f) => f.type === "exec.exit" && f.pid === a.pid)).exit_code, 3);
  c.send({ type: "exec.signal", pid: b.pid, signal: "SIGTERM" });
  const exit = await c.next((f) => f.type === "exec.exit" && f.pid === b.pid);
  assert.equal(exit.signal, "SIGTERM");
  c.ws.close();
});

test("PTY: echo, and stty size shows the resize", async () => {
  const c = connect();
  await c.opened;
  c.send({ type: "pty.start", request_id: "p", cmd: "/bin/bash", cols: 80, rows: 24 });
  const s = await c.next((f) => f.type === "pty.started" && f.request_id === "p");
  assert.ok(s.session_id && s.pid > 0);
  c.send({ type: "pty.input", session_id: s.session_id, data: "stty size\n" });
  await c.ptyUntil(s.session_id, /24 80/);
  c.send({ type: "pty.resize", session_id: s.session_id, cols: 132, rows: 43 });
  c.send({ type: "pty.input", session_id: s.session_id, data_base64: Buffer.from("stty size\n").toString("base64") });
  await c.ptyUntil(s.session_id, /43 132/);
  c.send({ type: "pty.input", pid: s.pid, data: "exit 5\n" });
  const exit = await c.next((f) => f.type === "pty.exit" && f.session_id === s.session_id);
  assert.equal(exit.exit_code, 5);
  c.ws.close();
});

test("PTY sessions outlive the socket: reconnect by session_id and by pid replays from an offset; two sockets see output", async () => {
  const c1 = connect();
  await c1.opened;
  c1.send({ type: "pty.start", request_id: "p", cmd: "/bin/sh", cols: 80, rows: 24 });
  const s = await c1.next((f) => f.type === "pty.started");
  c1.send({ type: "pty.input", session_id: s.session_id, data: "echo first-marker\n" });
  await c1.ptyUntil(s.session_id, /first-marker\r?\n/);
  c1.ws.close();
  await new Promise((r) => setTimeout(r, 100));

  const c2 = connect();
  await c2.opened;
  c2.send({ type: "pty.reconnect", session_id: s.session_id, offset: 0 });
  const rc = await c2.next((f) => f.type === "pty.reconnected");
  assert.equal(rc.session_id, s.session_id);
  assert.equal(rc.pid, s.pid);
  const replay = await c2.ptyUntil(s.session_id, /first-marker\r?\n/);
  assert.ok(replay.includes("first-marker"));

  const c3 = connect();
  await c3.opened;
  c3.send({ type: "pty.reconnect", pid: s.pid, offset: rc.offset });
  await c3.next((f) => f.type === "pty.reconnected");
  c2.send({ type: "pty.input", session_id: s.session_id, data: "echo both-see-this\n" });
  await c2.ptyUntil(s.session_id, /both-see-this\r?\n/);
  await c3.ptyUntil(s.session_id, /both-see-this\r?\n/);
  c2.ws.close();
  c3.ws.close();
});

test("every exactly-one rule answers an error frame with invalid_request and keeps the socket open", async () => {
  const c = connect();
  await c.opened;
  const bad = [
    { type: "pty.input", data: "x" },
    { type: "pty.input", session_id: "s", pid: 1, data: "x" },
    { type: "pty.input", session_id: "s" },
    { type: "pty.input", session_id: "s", data: "x", data_base64: "eA==" },
    { type: "pty.reconnect" },
    { type: "pty.reconnect", session_id: "s", pid: 1 },
    { type: "pty.resize", cols: 1, rows: 1 },
    { type: "pty.kill", session_id: "s", pid: 3 },
    { type: "no.such.frame" },
    { type: "pty.start", cols: "wide", rows: 3 },
  ];
  for (const [i, f] of bad.entries()) {
    c.send({ ...f, request_id: `bad-${i}` });
    const e = await c.next((x) => x.type === "error" && x.request_id === `bad-${i}`);
    assert.equal(e.code, "invalid_request", JSON.stringify(f));
  }
  c.ws.send("{not json");
  assert.equal((await c.next((x) => x.type === "error")).code, "invalid_request");
  // Still open and working.
  c.send({ type: "exec.start", request_id: "ok", cmd: "true" });
  await c.next((x) => x.type === "exec.started" && x.request_id === "ok");
  c.ws.close();
});

test("reconnecting to an unknown session answers not_found", async () => {
  const c = connect();
  await c.opened;
  c.send({ type: "pty.reconnect", session_id: "no-such-session", request_id: "r" });
  assert.equal((await c.next((x) => x.type === "error")).code, "not_found");
  c.ws.close();
});

test("keepalive: pings at the configured interval; two missed pongs close the socket", async () => {
  const c = connect(m.id, { autoPong: false });
  await c.opened;
  const pings: number[] = [];
  c.ws.on("ping", () => pings.push(Date.now()));
  const closed = await new Promise<number>((resolve) => c.ws.on("close", (code) => resolve(code)));
  assert.ok(pings.length >= 2, `saw ${pings.length} pings`);
  assert.ok(pings[1] - pings[0] >= 150 && pings[1] - pings[0] < 1000, `ping interval ${pings[1] - pings[0]} ms`);
  assert.ok([1001, 1006].includes(closed));
  const healthy = connect();
  await healthy.opened;
  await new Promise((r) => setTimeout(r, 900));
  assert.equal(healthy.ws.readyState, WebSocket.OPEN, "a client that answers pongs stays connected");
  healthy.ws.close();
});

test("PTY sessions do not survive hibernate/resume", async () => {
  const mm = (await k.call("POST", "/v1/machines", { body: {} })).body;
  const c = connect(mm.id);
  await c.opened;
  c.send({ type: "pty.start", request_id: "p", cmd: "/bin/sh", cols: 80, rows: 24 });
  const s = await c.next((f) => f.type === "pty.started");
  const closed = new Promise((r) => c.ws.on("close", r));
  await k.call("POST", `/v1/machines/${mm.id}/hibernate`);
  await closed;
  await k.call("POST", `/v1/machines/${mm.id}/resume`);
  const c2 = connect(mm.id);
  await c2.opened;
  c2.send({ type: "pty.reconnect", session_id: s.session_id });
  assert.equal((await c2.next((x) => x.type === "error")).code, "not_found");
  c2.ws.close();
});

test("a flood of output to a client that does not read does not grow server memory without bound", async () => {
  const c = connect();
  await c.opened;
  c.send({ type: "exec.start", request_id: "flood", cmd: "head -c 400000000 /dev/zero" });
  await c.next((f) => f.type === "exec.started");
  // Stop reading: the kernel socket buffers fill, the server must pause the machine's output.
  (c.ws as any)._socket.pause();
  const before = process.memoryUsage().rss;
  await new Promise((r) => setTimeout(r, 3000));
  const grown = process.memoryUsage().rss - before;
  assert.ok(grown < 150 * 1024 * 1024, `server grew ${Math.round(grown / 1048576)} MiB while the client did not read`);
  c.ws.terminate();
});
