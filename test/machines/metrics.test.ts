// GET /v1/machines/{id}/metrics on a real machine: CPU from its cgroup follows a busy loop, memory follows an
// allocation against the machine's limit, disk follows a file written on its writable layer against disk_mb.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

let k: TestKiln;
let m: any;
before(async () => {
  k = await startTestKiln();
  m = (await k.call("POST", "/v1/machines", { body: { vcpus: 1, memory_mb: 512, disk_mb: 1024 } })).body;
  assert.ok(m.id, JSON.stringify(m));
});
after(async () => k?.close());

const metrics = async () => {
  const r = await k.call("GET", `/v1/machines/${m.id}/metrics`);
  assert.equal(r.status, 200, JSON.stringify(r.body));
  return r.body;
};
const exec = async (cmd: string) => {
  const r = await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd } });
  assert.equal(r.body.exit_code, 0, JSON.stringify(r.body));
  return r.body;
};

test("machine metrics: limits as the machine was made, usage read from its cgroup and its disk", async () => {
  const idle = await metrics();
  assert.equal(idle.machine_id, m.id);
  assert.equal(idle.cpu_count, 1);
  assert.equal(idle.mem_total_bytes, 512 * 1024 * 1024);
  assert.ok(idle.mem_used_bytes > 0 && idle.mem_used_bytes < idle.mem_total_bytes, JSON.stringify(idle));
  // ext4 takes a little of the image for itself: the total is the disk's size less its metadata.
  assert.ok(idle.disk_total_bytes > 900 * 1024 * 1024 && idle.disk_total_bytes <= 1024 * 1024 * 1024, JSON.stringify(idle));
  assert.ok(idle.cpu_usage_ns > 0);
  assert.ok(idle.cpu_used_pct >= 0 && idle.cpu_used_pct < 50, `idle machine at ${idle.cpu_used_pct}%`);

  // 64 MiB written to the machine's disk shows as used disk (not in /tmp: gVisor keeps its own tmpfs there).
  await exec("head -c 67108864 /dev/urandom > /workspace/blob && sync");
  const written = await metrics();
  assert.ok(written.disk_used_bytes - idle.disk_used_bytes >= 60 * 1024 * 1024, `disk ${idle.disk_used_bytes} → ${written.disk_used_bytes}`);

  // A fixed amount of work (about half a second of CPU here), measured over the window since the previous call.
  // The work, not the wall time, is fixed: on a loaded host the loop gets less of a core but uses the same CPU.
  const before = await metrics();
  await exec("i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done");
  const busy = await metrics();
  const usedMs = (busy.cpu_usage_ns - before.cpu_usage_ns) / 1e6;
  assert.ok(usedMs > 250, `cpu ns ${before.cpu_usage_ns} → ${busy.cpu_usage_ns}`);
  // The share is that CPU over the window (one vCPU), give or take what ran between the reads and the window's ends.
  const share = (usedMs / busy.cpu_window_ms) * 100;
  assert.ok(busy.cpu_used_pct > 0 && Math.abs(busy.cpu_used_pct - share) <= Math.max(5, share * 0.25), `busy machine at ${busy.cpu_used_pct}% over ${busy.cpu_window_ms} ms, ${Math.round(usedMs)} ms of CPU (${share.toFixed(1)}%)`);
});

test("machine metrics: unknown machine 404, hibernated machine 409", async () => {
  assert.equal((await k.call("GET", "/v1/machines/mch_00000000000000000000000000/metrics")).status, 404);
  const other = (await k.call("POST", "/v1/machines", { body: {} })).body;
  assert.equal((await k.call("POST", `/v1/machines/${other.id}/hibernate`)).status, 200);
  const r = await k.call("GET", `/v1/machines/${other.id}/metrics`);
  assert.equal(r.status, 409);
  assert.equal(r.body.code, "machine_not_running");
  await k.call("DELETE", `/v1/machines/${other.id}`);
});
