// The guest agent's kept processes (src/agent/kept.ts), on its stream socket: a start with `keep` outlives its socket,
// a later socket lists it (kept.list), re-attaches by pid with a replay from an offset (exec.attach), signals it and
// writes its stdin; exited ones are reaped after the grace; a kept PTY outlives /sessions/reset. Without `keep`,
// nothing changes (streams.test.ts covers that exec processes still belong to their socket).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startAgent, openStream, text } from "./support.ts";
import type { StreamClient, TestAgent } from "./support.ts";

let agent: TestAgent;
before(async () => {
  agent = await startAgent({ env: { KILN_AGENT_KEPT_GRACE_MS: "700" } });
});
after(() => agent?.stop());

/** Output of `pid` on `c` from the frames that follow, until `pattern` matches; with each chunk's offset. */
async function outputUntil(c: StreamClient, pid: number, pattern: RegExp): Promise<{ text: string; offsets: number[] }> {
  let out = "";
  const offsets: number[] = [];
  while (!pattern.test(out)) {
    const f = await c.next((x) => x.pid === pid && (x.type === "exec.stdout" || x.type === "exec.stderr"));
    offsets.push(f.offset);
    out += text(f.data_base64);
  }
  return { text: out, offsets };
}

test("a kept exec process outlives its socket; another socket lists it with its label, re-attaches from an offset (replay, then live), writes its stdin and signals it", async () => {
  const a = await openStream(agent);
  a.send({ type: "exec.start", request_id: "k1", cmd: "echo one; read line; echo two-$line; read line; echo three-$line; sleep 30", stdin: true, keep: true, label: "my-tag" });
  const { pid } = await a.next((f) => f.type === "exec.started" && f.request_id === "k1");
  const first = await outputUntil(a, pid, /one\n/);
  assert.deepEqual(first.offsets, [0]);
  await a.close();

  const b = await openStream(agent);
  b.send({ type: "kept.list", request_id: "l1" });
  const listed = await b.next((f) => f.type === "kept.listed" && f.request_id === "l1");
  const mine = listed.processes.find((p: { pid: number }) => p.pid === pid);
  assert.deepEqual({ kind: mine.kind, label: mine.label, running: mine.running }, { kind: "exec", label: "my-tag", running: true }, "still running after its socket closed");
  // Input and output while no socket is attached: the ring holds it.
  b.send({ type: "exec.stdin", pid, data: "x\n" });
  await new Promise((r) => setTimeout(r, 300));
  b.send({ type: "exec.attach", request_id: "at1", pid, offset: 4 });
  const attached = await b.next((f) => f.type === "exec.attached" && f.request_id === "at1");
  assert.equal(attached.offset, 4);
  assert.equal(attached.truncated, undefined);
  const replay = await outputUntil(b, pid, /two-x\n/);
  assert.equal(replay.text, "two-x\n", "the replay starts at the offset asked for");
  assert.deepEqual(replay.offsets, [4]);
  b.send({ type: "exec.stdin", pid, data: "y\n" });
  const live = await outputUntil(b, pid, /three-y\n/);
  assert.deepEqual(live.offsets, [10]);
  b.send({ type: "exec.signal", pid, signal: "TERM" });
  const exit = await b.next((f) => f.type === "exec.exit" && f.pid === pid);
  assert.equal(exit.signal, "SIGTERM");

  // Exited: still attachable within the grace (replay and exit), then reaped.
  b.send({ type: "exec.attach", request_id: "at2", pid });
  await b.next((f) => f.type === "exec.attached" && f.request_id === "at2");
  assert.equal((await outputUntil(b, pid, /three-y\n/)).text, "one\ntwo-x\nthree-y\n");
  assert.equal((await b.next((f) => f.type === "exec.exit" && f.pid === pid)).signal, "SIGTERM");
  b.send({ type: "exec.signal", request_id: "s2", pid, signal: "KILL" });
  assert.equal((await b.next((f) => f.type === "error" && f.request_id === "s2")).code, "not_found", "an exited process is not signalled");
  await new Promise((r) => setTimeout(r, 1000));
  b.send({ type: "exec.attach", request_id: "at3", pid });
  assert.equal((await b.next((f) => f.type === "error" && f.request_id === "at3")).code, "not_found");
  await b.close();
});

test("keep and label are checked: a label needs keep, keep must be a boolean; a non-kept start is not listed", async () => {
  const c = await openStream(agent);
  c.send({ type: "exec.start", request_id: "v1", cmd: "true", label: "x" });
  assert.equal((await c.next((f) => f.type === "error" && f.request_id === "v1")).code, "invalid_request");
  c.send({ type: "exec.start", request_id: "v2", cmd: "true", keep: "yes" });
  assert.equal((await c.next((f) => f.type === "error" && f.request_id === "v2")).code, "invalid_request");
  c.send({ type: "exec.start", request_id: "v3", cmd: "true", keep: true, label: "x".repeat(1025) });
  assert.equal((await c.next((f) => f.type === "error" && f.request_id === "v3")).code, "invalid_request");
  c.send({ type: "exec.start", request_id: "v4", cmd: "sleep", args: ["30"] });
  const { pid } = await c.next((f) => f.type === "exec.started" && f.request_id === "v4");
  c.send({ type: "kept.list", request_id: "l2" });
  const listed = await c.next((f) => f.type === "kept.listed" && f.request_id === "l2");
  assert.equal(listed.processes.some((p: { pid: number }) => p.pid === pid), false);
  await c.close();
});

test("POST /sessions/reset (a resume) ends plain PTY sessions and leaves kept ones", async () => {
  const c = await openStream(agent);
  c.send({ type: "pty.start", request_id: "p1", cmd: "cat", args: [], cols: 80, rows: 24 });
  const plain = await c.next((f) => f.type === "pty.started" && f.request_id === "p1");
  c.send({ type: "pty.start", request_id: "p2", cmd: "cat", args: [], cols: 80, rows: 24, keep: true, label: "term" });
  const kept = await c.next((f) => f.type === "pty.started" && f.request_id === "p2");
  await agent.client.resetSessions();
  c.send({ type: "pty.reconnect", request_id: "r1", session_id: plain.session_id });
  assert.equal((await c.next((f) => f.type === "error" && f.request_id === "r1")).code, "not_found");
  c.send({ type: "pty.reconnect", request_id: "r2", session_id: kept.session_id });
  await c.next((f) => f.type === "pty.reconnected" && f.request_id === "r2");
  c.send({ type: "kept.list", request_id: "l3" });
  const listed = await c.next((f) => f.type === "kept.listed" && f.request_id === "l3");
  assert.deepEqual(
    listed.processes.filter((p: { kind: string }) => p.kind === "pty").map((p: { session_id: string; label: string }) => [p.session_id, p.label]),
    [[kept.session_id, "term"]],
  );
  c.send({ type: "pty.kill", session_id: kept.session_id, signal: "KILL" });
  await c.next((f) => f.type === "pty.exit" && f.session_id === kept.session_id);
  await c.close();
});
