// Bursts: more creates at once than the warm pool holds, of mixed shapes, all succeed — boots a few at a time in
// the order the creates came (boot-queue.ts) — and once they are deleted nothing of any of them is left.

import { test } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import { remainsOf } from "../support/remains.ts";

const BURST = 50;

test("a burst of 50 creates of mixed shapes all succeed, each machine in its own shape, and nothing leaks", async () => {
  const k = await startTestKiln({ env: { KILN_WARM_POOL: "2" } });
  try {
    const shapes = [
      { vcpus: 1, memory_mb: 512 },
      { vcpus: 2, memory_mb: 256, internet: false },
      {},
      { memory_mb: 1024, network: { deny_out: ["10.0.0.0/8"] } },
      { vcpus: 1, memory_mb: 384, internet: false, template: "local/base" },
    ];
    const wanted = Array.from({ length: BURST }, (_, i) => shapes[i % shapes.length]);
    const made = await Promise.all(wanted.map((body) => k.call("POST", "/v1/machines", { body })));
    for (const [i, m] of made.entries()) assert.equal(m.status, 201, `create ${i}: ${m.text}`);
    const ids = made.map((m) => m.body.id as string);
    assert.equal(new Set(ids).size, BURST, "every create has its own machine");
    // Each one runs and is the shape it was asked for.
    const checks = await Promise.all(ids.map((id) => k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd: "echo ok" } })));
    for (const [i, r] of checks.entries()) {
      assert.equal(r.status, 200, r.text);
      assert.equal(r.body.stdout, "ok\n");
      const want = wanted[i] as { vcpus?: number; memory_mb?: number; internet?: boolean };
      assert.equal(made[i].body.vcpus, want.vcpus ?? 1);
      assert.equal(made[i].body.memory_mb, want.memory_mb ?? 1024);
      assert.equal(made[i].body.internet, want.internet ?? true);
    }
    const boots = k.kiln.services.machines;
    const dels = await Promise.all(ids.map((id) => k.call("DELETE", `/v1/machines/${id}`, { settle: false })));
    for (const d of dels) assert.equal(d.status, 200, d.text);
    assert.equal(await boots.cleanupsSettled(180_000), true, "every cleanup finished");
    for (const id of ids) assert.deepEqual(remainsOf(k.dataDir, id), [], `nothing of ${id} is left`);
  } finally {
    await k.close();
  }
});
