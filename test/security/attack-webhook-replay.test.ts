// A key holder against webhook replay (issue 23): replaying in a loop, sequentially and in a concurrent burst, while
// the receiver is failing stops at the bound of pending deliveries (429, retryable); another webhook's delivery id,
// or a delivery id under another webhook, is 404 and queues nothing.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startReceiver } from "../webhooks/receiver.ts";
import type { Receiver } from "../webhooks/receiver.ts";
import { MAX_PENDING_DELIVERIES_PER_WEBHOOK } from "../../src/webhooks/service.ts";

let k: TestKiln;
let rx: Receiver;
let machineId: string;

before(async () => {
  rx = await startReceiver();
  // Slow retries: a failing delivery stays queued for the test's length.
  k = await startTestKiln({ env: { KILN_WEBHOOK_ALLOW_PRIVATE: "1", KILN_WEBHOOK_RETRY_SCHEDULE_MS: "0,600000,600000", KILN_WARM_POOL: "0" } });
  const m = await k.call("POST", "/v1/machines", { body: {} });
  assert.equal(m.status, 201, m.text);
  machineId = m.body.id;
});
after(async () => {
  await k?.close();
  await rx?.close();
});

async function pendingOf(hookId: string): Promise<number> {
  let n = 0;
  for (const status of ["queued", "in_progress"]) {
    let cursor: string | undefined;
    do {
      const res = await k.call("GET", `/v1/lifecycle/webhooks/${hookId}/deliveries?status=${status}&limit=100${cursor ? `&cursor=${cursor}` : ""}`);
      assert.equal(res.status, 200, res.text);
      n += res.body.deliveries.length;
      cursor = res.body.next_cursor ?? undefined;
    } while (cursor);
  }
  return n;
}

test("replaying in a loop and in a burst stops at the bound of pending deliveries; other webhooks' delivery ids are 404", async () => {
  rx.respond = () => ({ status: 503, body: "down" });
  const mk = async (path: string) => (await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: `${rx.url}/${path}`, operations: ["update"] } })).body as { id: string };
  const hook = await mk("flood");
  const other = await mk("other");
  const renamed = await k.call("PATCH", `/v1/machines/${machineId}`, { body: { name: "replay-flood" } });
  assert.equal(renamed.status, 200, renamed.text);
  let deliveryId: string | undefined;
  let otherDelivery: string | undefined;
  for (let i = 0; i < 100 && !(deliveryId && otherDelivery); i++) {
    deliveryId = (await k.call("GET", `/v1/lifecycle/webhooks/${hook.id}/deliveries`)).body.deliveries[0]?.id;
    otherDelivery = (await k.call("GET", `/v1/lifecycle/webhooks/${other.id}/deliveries`)).body.deliveries[0]?.id;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.ok(deliveryId && otherDelivery, "each webhook has its delivery");

  assert.equal((await k.call("POST", `/v1/lifecycle/webhooks/${hook.id}/deliveries/${otherDelivery}/replay`)).status, 404, "another webhook's delivery");
  assert.equal((await k.call("POST", `/v1/lifecycle/webhooks/${other.id}/deliveries/${deliveryId}/replay`)).status, 404, "under another webhook");

  const replay = () => k.call("POST", `/v1/lifecycle/webhooks/${hook.id}/deliveries/${deliveryId}/replay`);
  let accepted = 0;
  let refused: { status: number; body: any } | undefined;
  // Sequentially up to near the bound, then a concurrent burst across it.
  while (accepted < MAX_PENDING_DELIVERIES_PER_WEBHOOK - 40) {
    const batch = await Promise.all(Array.from({ length: 10 }, replay));
    for (const r of batch) {
      if (r.status === 202) accepted++;
      else refused = r;
    }
    assert.equal(refused, undefined, "no refusal below the bound");
  }
  const burst = await Promise.all(Array.from({ length: 100 }, replay));
  const codes = burst.map((r) => r.status);
  assert.ok(codes.every((c) => c === 202 || c === 429), `only accepted or rate_limited: ${[...new Set(codes)]}`);
  refused = burst.find((r) => r.status === 429);
  assert.ok(refused, "the burst crosses the bound");
  assert.equal(refused.body.code, "rate_limited");
  assert.equal(refused.body.error_detail?.retryable ?? refused.body.retryable ?? true, true);
  assert.ok((await pendingOf(hook.id)) <= MAX_PENDING_DELIVERIES_PER_WEBHOOK, "never more pending than the bound");
  assert.equal((await pendingOf(other.id)) <= 1, true, "the other webhook got nothing");
  await k.call("DELETE", `/v1/lifecycle/webhooks/${hook.id}`);
  await k.call("DELETE", `/v1/lifecycle/webhooks/${other.id}`);
});
