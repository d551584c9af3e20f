// The `e2b` SDK's Sandbox.getMetrics against a real Kiln: one point, now, from the machine's cgroup and disk; the
// many-sandbox endpoint (GET /sandboxes/metrics) over plain HTTP.

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
  sbx = await Sandbox.create("base", opts);
});
after(async () => k?.close());

test("getMetrics returns the sandbox's CPU, memory and disk now", async () => {
  const [m, ...rest] = await sbx.getMetrics();
  assert.equal(rest.length, 0);
  assert.ok(m.timestamp instanceof Date && Math.abs(m.timestamp.getTime() - Date.now()) < 60_000);
  const machine = (await k.call("GET", `/v1/machines/mch_${sbx.sandboxId}`)).body;
  assert.equal(m.cpuCount, machine.vcpus);
  assert.equal(m.memTotal, machine.memory_mb * 1024 * 1024);
  assert.ok(m.memUsed > 0 && m.memUsed < m.memTotal);
  assert.ok(m.diskTotal > 0 && m.diskUsed > 0 && m.diskUsed < m.diskTotal);
  assert.ok(m.cpuUsedPct >= 0 && m.cpuUsedPct <= 100);
  // A range that ends before now holds no point (Kiln keeps no history).
  assert.deepEqual(await Sandbox.getMetrics(sbx.sandboxId, { ...opts, end: new Date(Date.now() - 3_600_000) }), []);
  await assert.rejects(Sandbox.getMetrics("00000000000000000000000000", opts), SandboxNotFoundError);
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
