// The `e2b` SDK's Sandbox.getMetrics against a real Kiln: the machine's samples (every 5 s, the last hour) from its
// cgroup and disk, over a time range; the many-sandbox endpoint (GET /sandboxes/metrics) over plain HTTP.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { Sandbox, SandboxNotFoundError } from "e2b";
import type { SandboxOpts } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";

let k: TestKiln;
let key: string;
let opts: SandboxOpts;
let sbx: Sandbox;

before(async () => {
  k = await startTestKiln();
  key = (await k.kiln.services.keys.create("e2b-metrics", generateKeyIn("e2b"))).key;
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 30_000 };
  sbx = await Sandbox.create("base", { ...opts, timeoutMs: 300_000 }); // outlives the range test's wait
});
after(async () => k?.close());

test("getMetrics gives a fresh sandbox one point, now, with its CPU, memory and disk", async () => {
  const fresh = await Sandbox.create("base", opts);
  try {
    const [m, ...rest] = await fresh.getMetrics();
    assert.ok(rest.length <= 1, "at most the sampler's first sample besides");
    assert.ok(m.timestamp instanceof Date && Math.abs(m.timestamp.getTime() - Date.now()) < 60_000);
    const machine = (await k.call("GET", `/v1/machines/mch_${fresh.sandboxId}`)).body;
    assert.equal(m.cpuCount, machine.vcpus);
    assert.equal(m.memTotal, machine.memory_mb * 1024 * 1024);
    assert.ok(m.memUsed > 0 && m.memUsed < m.memTotal);
    assert.ok(m.diskTotal > 0 && m.diskUsed > 0 && m.diskUsed < m.diskTotal);
    assert.ok(m.cpuUsedPct >= 0 && m.cpuUsedPct <= 100);
  } finally {
    await fresh.kill();
  }
  await assert.rejects(Sandbox.getMetrics("00000000000000000000000000", opts), SandboxNotFoundError);
});

test("getMetrics over a time range: samples every 5 s, oldest first, only those in the range", async () => {
  let all: Awaited<ReturnType<Sandbox["getMetrics"]>> = [];
  // The sampler takes one every 5 s: wait (bounded) until three are kept.
  for (let i = 0; i < 300 && all.length < 3; i++) {
    await new Promise((r) => setTimeout(r, 100));
    all = await sbx.getMetrics();
  }
  assert.ok(all.length >= 3, `three samples kept, got ${all.length}`);
  const times = all.map((m) => m.timestamp.getTime());
  for (let i = 1; i < times.length; i++) {
    const gap = times[i] - times[i - 1];
    assert.ok(gap >= 4_000 && gap <= 15_000, `samples ~5 s apart, got ${gap} ms`);
  }
  for (const m of all) assert.ok(m.memTotal > 0 && m.memUsed > 0 && m.diskTotal > 0);
  // The SDK sends whole seconds: a range from the second sample's second on leaves out the first.
  const from = new Date(Math.ceil(times[1] / 1000) * 1000 - 1000);
  const later = await Sandbox.getMetrics(sbx.sandboxId, { ...opts, start: from });
  assert.ok(later.length >= 2 && later.length < all.length + 2, `${later.length}`);
  assert.ok(later.every((m) => m.timestamp.getTime() >= from.getTime()));
  const upTo = await Sandbox.getMetrics(sbx.sandboxId, { ...opts, end: new Date(Math.floor(times[0] / 1000) * 1000 + 1000) });
  assert.ok(upTo.length >= 1 && upTo.every((m) => m.timestamp.getTime() <= times[0] + 1000));
  // Before the sandbox existed: nothing.
  assert.deepEqual(await Sandbox.getMetrics(sbx.sandboxId, { ...opts, end: new Date(Date.now() - 3_600_000) }), []);
});

test("GET /sandboxes/metrics answers the running sandboxes among those asked", async () => {
  const res = await request(`${k.url}/sandboxes/metrics?sandbox_ids=${sbx.sandboxId},00000000000000000000000000`, { headers: { "x-api-key": key } });
  assert.equal(res.statusCode, 200);
  const body = (await res.body.json()) as { sandboxes: Record<string, { cpuCount: number; memTotal: number }> };
  assert.deepEqual(Object.keys(body.sandboxes), [sbx.sandboxId]);
  assert.ok(body.sandboxes[sbx.sandboxId].memTotal > 0);
  const refused = await request(`${k.url}/sandboxes/metrics?sandbox_ids=${sbx.sandboxId}`, { headers: { "x-api-key": "e2b_0000000000000000000000000000000000000000" } });
  assert.equal(refused.statusCode, 401);
  await refused.body.dump();
});
