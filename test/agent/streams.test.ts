// The guest agent's stream socket (/ws): exec streams that belong to their socket, PTY sessions that outlive
// sockets (offsets, ring-buffer replay, two sockets on one session, the grace period), and frame errors that
// leave the socket open.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startAgent, openStream, ALL_BYTES, text } from "./support.ts";
import type { TestAgent } from "./support.ts";

let agent: TestAgent;
before(async () => {
  agent = await startAgent({ env: { KILN_AGENT_PTY_GRACE_MS: "700" } });
});
after(() => agent?.stop());

test("exec stream: all 256 byte values through stdin and back through stdout", async () => {
  const c = await openStream(agent);
  c.send({ type: "exec.start", request_id: "r1", cmd: "cat", args: [], stdin: true });
  const started = await c.next((f) => f.type === "exec.started");
  assert.equal(started.request_id, "r1");
  c.send({ type: "exec.stdin", pid: started.pid, data_base64: ALL_BYTES.subarray(0, 100).toString("base64") });
  c.send({ type: "exec.stdin", pid: started.pid, data_base64: ALL_BYTES.subarray(100).toString("base64"), eof: true });
  const out: Buffer[] = [];
  for (;;) {
    const f = await c.next((x) => x.pid === started.pid && (x.type === "exec.stdout" || x.type === "exec.exit"));
    if (f.type === "exec.exit") {
      assert.equal(f.exit_code, 0);
      assert.equal(f.signal, null);
      break;
    }
    out.push(Buffer.from(f.data_base64, "base64"));
  }
  assert.deepEqual(Buffer.concat(out), ALL_BYTES);
  await c.close();
});

test("exec stream: stderr, legacy text stdin, a signal to the process and its exit", async () => {
  const c = await openStream(agent);
  c.send({ type: "exec.start", request_id: "r2", cmd: "echo err >&2; read line; echo got:$line; sleep 30", stdin: true });
  const { pid } = await c.next((f) => f.type === "exec.started" && f.request_id === "r2");
  assert.equal(text((await c.next((f) => f.type === "exec.stderr" && f.pid === pid)).data_base64), "err\n");
  c.send({ type: "exec.stdin", pid, data: "héllo\n" });
  assert.equal(text((await c.next((f) => f.type === "exec.stdout" && f.pid === pid)).data_base64), "got:héllo\n");
  c.send({ type: "exec.signal", pid, signal: "TERM" });
  const exit = await c.next((f) => f.type === "exec.exit" && f.pid === pid);
  assert.equal(exit.signal, "SIGTERM");
  assert.equal(exit.exit_code, null);
  await c.close();
});

test("exec processes belong to the socket that started them: closing it kills them", async () => {
  const c = await openStream(agent);
  c.send({ type: "exec.start", request_id: "r3", cmd: "sleep", args: ["30"] });
  const { pid } = await c.next((f) => f.type === "exec.started");
  await c.close();
  const deadline = Date.now() + 3_000;
  while (Date.now() < deadline) {
    try {
      process.kill(pid, 0);
      const stat = await import("node:fs/promises").then((fs) => fs.readFile(`/proc/${pid}/stat`, "utf8")).catch(() => "");
      if (!stat || stat.slice(stat.lastIndexOf(")") + 2).startsWith("Z")) return;
    } catch {
      return;
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.fail("the process outlived its socket");
});

test("malformed frames and the exactly-one rules answer invalid_request and the socket stays open", async () => {
  const c = await openStream(agent);
  const bad: [unknown, RegExp][] = [
    ["not json", /JSON object/],
    [{ type: "no.such", request_id: "x" }, /Unknown frame type/],
    [{ type: "exec.start", request_id: "x" }, /cmd/],
    [{ type: "exec.start", request_id: "x", cmd: "true", args: "nope" }, /args/],
    [{ type: "pty.input", request_id: "x", data: "a" }, /exactly one of session_id or pid/],
    [{ type: "pty.input", request_id: "x", session_id: "s", pid: 1, data: "a" }, /exactly one of session_id or pid/],
    [{ type: "pty.input", request_id: "x", session_id: "s" }, /exactly one of data_base64 or data/],
    [{ type: "pty.input", request_id: "x", session_id: "s", data: "a", data_base64: "YQ==" }, /exactly one of data_base64 or data/],
    [{ type: "pty.reconnect", request_id: "x" }, /exactly one of session_id or pid/],
    [{ type: "pty.resize", request_id: "x", cols: 80, rows: 24 }, /exactly one of session_id or pid/],
  ];
  for (const [frame, message] of bad) {
    c.send(frame);
    const err = await c.next((f) => f.type === "error");
    assert.equal(err.code, "invalid_request", JSON.stringify(frame));
    assert.match(err.error, message);
    if (typeof frame === "object") assert.equal(err.request_id, "x");
  }
  c.send({ type: "pty.reconnect", request_id: "y", session_id: "no-such-session" });
  assert.equal((await c.next((f) => f.type === "error")).code, "not_found");
  c.send({ type: "exec.start", request_id: "alive", cmd: "true" });
  assert.equal((await c.next((f) => f.type === "exec.started")).request_id, "alive");
  await c.close();
});

test("PTY: echo, a login shell by default, and stty size after a resize", async () => {
  const c = await openStream(agent);
  c.send({ type: "pty.start", request_id: "p1", cols: 80, rows: 24 });
  const started = await c.next((f) => f.type === "pty.started");
  assert.equal(started.request_id, "p1");
  const s = started.session_id;
  c.send({ type: "pty.input", session_id: s, data: "echo $((6*7)) $TERM\r" });
  await c.ptyUntil(s, /42 xterm-256color/);
  c.send({ type: "pty.resize", session_id: s, cols: 100, rows: 31 });
  c.send({ type: "pty.input", pid: started.pid, data_base64: Buffer.from("stty size\r").toString("base64") });
  await c.ptyUntil(s, /31 100/);
  c.send({ type: "pty.input", session_id: s, data: "env\r" });
  const env = await c.ptyUntil(s, /LANG=C\.UTF-8[\s\S]*\$ $|\# $/);
  assert.doesNotMatch(env, /KILN_AGENT_PTY_GRACE_MS|NODE_/);
  c.send({ type: "pty.input", session_id: s, data: "exit 3\r" });
  const exit = await c.next((f) => f.type === "pty.exit" && f.session_id === s);
  assert.equal(exit.exit_code, 3);
  await c.close();
});

test("PTY offsets count bytes; reconnect on a new socket replays from an offset, then live output follows", async () => {
  const a = await openStream(agent);
  a.send({ type: "pty.start", request_id: "p2", cmd: "cat", args: [], cols: 80, rows: 24 });
  const { session_id: s, pid } = await a.next((f) => f.type === "pty.started");
  a.send({ type: "pty.input", session_id: s, data: "first\r" });
  const got = await a.ptyUntil(s, /first\r\n[\s\S]*first\r\n/);
  await a.close();

  const b = await openStream(agent);
  b.send({ type: "pty.reconnect", request_id: "re", pid, offset: 3 });
  const re = await b.next((f) => f.type === "pty.reconnected");
  assert.deepEqual({ session_id: re.session_id, pid: re.pid, offset: re.offset, truncated: re.truncated, request_id: re.request_id }, { session_id: s, pid, offset: 3, truncated: undefined, request_id: "re" });
  const replay = await b.next((f) => f.type === "pty.output");
  assert.equal(replay.offset, 3);
  assert.equal(text(replay.data_base64), got.slice(3));
  b.send({ type: "pty.input", session_id: s, data: "second\r" });
  const live = await b.next((f) => f.type === "pty.output");
  assert.equal(live.offset, Buffer.byteLength(got), "live output continues at the next byte offset");
  b.send({ type: "pty.kill", session_id: s });
  assert.equal((await b.next((f) => f.type === "pty.exit")).signal, "SIGHUP");
  await b.close();
});

test("two sockets attached to one session both see its output", async () => {
  const a = await openStream(agent);
  a.send({ type: "pty.start", cmd: "cat", args: [], cols: 80, rows: 24 });
  const { session_id: s } = await a.next((f) => f.type === "pty.started");
  const b = await openStream(agent);
  b.send({ type: "pty.reconnect", session_id: s, offset: 0 });
  await b.next((f) => f.type === "pty.reconnected");
  a.send({ type: "pty.input", session_id: s, data: "shared\r" });
  await Promise.all([a.ptyUntil(s, /shared/), b.ptyUntil(s, /shared/)]);
  b.send({ type: "pty.input", session_id: s, data: "\u0004" });
  await Promise.all([a.next((f) => f.type === "pty.exit"), b.next((f) => f.type === "pty.exit")]);
  await Promise.all([a.close(), b.close()]);
});

test("output past the 1 MiB ring buffer is gone: a replay from 0 says truncated", async () => {
  const c = await openStream(agent);
  c.send({ type: "pty.start", cmd: "head -c 1500000 /dev/zero | tr '\\0' x; echo; echo done", cols: 80, rows: 24 });
  const { session_id: s } = await c.next((f) => f.type === "pty.started");
  await c.next((f) => f.type === "pty.exit", 20_000);
  c.frames.length = 0;
  c.send({ type: "pty.reconnect", session_id: s, offset: 0 });
  const re = await c.next((f) => f.type === "pty.reconnected");
  assert.equal(re.truncated, true);
  assert.ok(re.offset > 400_000);
  let bytes = 0;
  for (;;) {
    const f = await c.next((x) => x.type === "pty.output" || x.type === "pty.exit");
    if (f.type === "pty.exit") break;
    bytes += Buffer.from(f.data_base64, "base64").length;
  }
  assert.equal(bytes, 1024 * 1024, "the ring holds exactly the last 1 MiB");
  await c.close();
});

test("a session ends a grace period after its process exits; then reconnect is not_found", async () => {
  const c = await openStream(agent);
  c.send({ type: "pty.start", cmd: "echo bye", cols: 80, rows: 24 });
  const { session_id: s } = await c.next((f) => f.type === "pty.started");
  await c.next((f) => f.type === "pty.exit");
  c.send({ type: "pty.reconnect", session_id: s });
  await c.next((f) => f.type === "pty.reconnected");
  assert.match(await c.ptyUntil(s, /bye/), /bye/);
  assert.equal((await c.next((f) => f.type === "pty.exit")).exit_code, 0, "a reconnect within the grace period sees the exit");
  await new Promise((r) => setTimeout(r, 900));
  c.send({ type: "pty.reconnect", session_id: s });
  assert.equal((await c.next((f) => f.type === "error")).code, "not_found");
  await c.close();
});

test("POST /sessions/reset ends every PTY session", async () => {
  const c = await openStream(agent);
  c.send({ type: "pty.start", cmd: "cat", args: [], cols: 80, rows: 24 });
  const { session_id: s } = await c.next((f) => f.type === "pty.started");
  assert.ok((await agent.client.resetSessions()).ended >= 1);
  c.send({ type: "pty.reconnect", session_id: s });
  assert.equal((await c.next((f) => f.type === "error")).code, "not_found");
  await c.close();
});
