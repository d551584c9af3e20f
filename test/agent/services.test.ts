// The guest agent's supervised services (the processes behind deployments), run for real on the host: start and
// re-start by id, crash restarts with backoff, a crash streak ended by a stable run, failure after too many crashes,
// request-only restart envs held for crash-restarts and dropped by the next restart, stop, and the output ring.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { AgentError } from "../../src/runtime/agent-client.ts";
import type { ServiceStartRequest, ServiceState } from "../../src/agent/protocol.ts";
import { startAgent, text } from "./support.ts";
import type { TestAgent } from "./support.ts";

let agent: TestAgent;
before(async () => {
  agent = await startAgent();
});
after(() => agent?.stop());

let n = 0;
function spec(cmd: string, extra: Partial<ServiceStartRequest> = {}): ServiceStartRequest {
  return { id: `svc_test${++n}`, cmd, max_crashes: 3, backoff_ms: 20, max_backoff_ms: 1000, stable_ms: 10_000, ...extra };
}

async function until(id: string, pred: (s: ServiceState) => boolean, timeoutMs = 10_000): Promise<ServiceState> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const s = await agent.client.serviceState(id);
    if (pred(s)) return s;
    if (Date.now() > deadline) assert.fail(`service ${id} never got there: ${JSON.stringify(s)}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

const output = async (id: string) => text((await agent.client.serviceLogs(id, 1 << 20)).data_base64);
/** A process that still runs (a zombie waiting for its reaper counts as ended: here on the host nobody is tini). */
const alive = (pid: number) => {
  try {
    return !/^\d+ \(.*\) Z /.test(readFileSync(`/proc/${pid}/stat`, "utf8"));
  } catch {
    return false;
  }
};

test("a service starts once per id: starting it again answers the running one", async () => {
  const s = spec("exec sleep 100");
  const first = await agent.client.startService(s);
  assert.equal(first.status, "running");
  assert.ok(first.pid && alive(first.pid));
  const again = await agent.client.startService(s);
  assert.equal(again.pid, first.pid);
  assert.ok((await agent.client.listServices()).services.some((x) => x.id === s.id));
  const stopped = await agent.client.stopService(s.id);
  assert.equal(stopped.status, "stopped");
  assert.equal(stopped.pid, null);
  assert.equal(alive(first.pid!), false);
});

test("a crashing process is started again with backoff and ends failed after max_crashes in a row", async () => {
  const s = spec("echo try; exit 2");
  await agent.client.startService(s);
  const failed = await until(s.id, (x) => x.status === "failed");
  assert.equal(failed.starts, 3);
  assert.equal(failed.crashes, 3);
  assert.equal(failed.consecutive_crashes, 3);
  assert.deepEqual({ code: failed.last_exit?.code, signal: failed.last_exit?.signal }, { code: 2, signal: null });
  assert.match(failed.failure_reason!, /exited 3 times in a row \(last: code 2\)/);
  const out = await output(s.id);
  assert.equal(out.match(/^try$/gm)?.length, 3);
  assert.match(out, /starting again in 20 ms/);
  assert.match(out, /starting again in 40 ms/, "the delay doubles");
});

test("a process that stayed up stable_ms ends the crash streak", async () => {
  const s = spec("sleep 0.15; exit 1", { max_crashes: 2, stable_ms: 100 });
  await agent.client.startService(s);
  const later = await until(s.id, (x) => x.crashes >= 3);
  assert.notEqual(later.status, "failed");
  assert.equal(later.consecutive_crashes, 1);
  await agent.client.stopService(s.id);
});

test("restart envs reach the new process and its crash-restarts; the next restart without envs drops them", async () => {
  const s = spec('echo "M=${M:-none} D=$D"; exec sleep 100', { envs: { D: "dep" } });
  await agent.client.startService(s);
  const lines = async () => (await output(s.id)).split("\n").filter((l) => l.startsWith("M="));
  const linesAtLeast = async (count: number) => {
    for (let i = 0; i < 200 && (await lines()).length < count; i++) await new Promise((r) => setTimeout(r, 20));
  };
  await linesAtLeast(1);
  const restarted = await agent.client.restartService(s.id, { M: "secret-1" });
  await linesAtLeast(2);
  assert.equal(restarted.status, "running");
  process.kill(restarted.pid!, "SIGKILL"); // a crash: the agent starts it again with the same envs
  const back = await until(s.id, (x) => x.status === "running" && x.pid !== restarted.pid);
  assert.equal(back.crashes, 1);
  await linesAtLeast(3);
  await agent.client.restartService(s.id);
  await linesAtLeast(4);
  assert.deepEqual(await lines(), ["M=none D=dep", "M=secret-1 D=dep", "M=secret-1 D=dep", "M=none D=dep"]);
  await agent.client.stopService(s.id);
});

test("stop ends the service's whole process group", async () => {
  const s = spec("sleep 100 & echo child=$!; exec sleep 100");
  const st = await agent.client.startService(s);
  await until(s.id, () => true);
  let child = 0;
  for (let i = 0; i < 100 && !child; i++) {
    child = Number(/child=(\d+)/.exec(await output(s.id))?.[1] ?? 0);
    await new Promise((r) => setTimeout(r, 20));
  }
  assert.ok(child > 0 && alive(child));
  await agent.client.stopService(s.id);
  assert.equal(alive(st.pid!), false);
  for (let i = 0; i < 50 && alive(child); i++) await new Promise((r) => setTimeout(r, 20));
  assert.equal(alive(child), false);
});

test("the output ring keeps the most recent 256 KiB and counts everything", async () => {
  const s = spec("head -c 1048576 /dev/zero | tr '\\0' a; echo; echo the-end; exec sleep 100");
  await agent.client.startService(s);
  let logs = await agent.client.serviceLogs(s.id, 1 << 20);
  for (let i = 0; i < 200 && !text(logs.data_base64).includes("the-end"); i++) {
    await new Promise((r) => setTimeout(r, 20));
    logs = await agent.client.serviceLogs(s.id, 1 << 20);
  }
  assert.ok(logs.total_bytes > 1048576);
  assert.equal(Buffer.from(logs.data_base64, "base64").length, 256 * 1024);
  assert.equal(logs.truncated, true);
  assert.match(text(logs.data_base64), /the-end\n$/);
  const tail = await agent.client.serviceLogs(s.id, 8);
  assert.equal(text(tail.data_base64), "the-end\n");
  await agent.client.stopService(s.id);
});

test("bad service requests are invalid_request; unknown ids are not_found", async () => {
  await assert.rejects(agent.client.startService({ ...spec("true"), envs: { A: 1 as unknown as string } }), (e: AgentError) => e.code === "invalid_request");
  await assert.rejects(agent.client.startService({ ...spec(""), cmd: "" }), (e: AgentError) => e.code === "invalid_request");
  await assert.rejects(agent.client.serviceState("svc_nope"), (e: AgentError) => e.code === "not_found");
  await assert.rejects(agent.client.restartService("svc_nope"), (e: AgentError) => e.code === "not_found");
});
