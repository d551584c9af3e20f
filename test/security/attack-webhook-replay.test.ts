// A key holder against webhook replay (issue 23): replaying in a loop, sequentially and in a concurrent burst, while
// the receiver is failing stops at the bound of pending deliveries (429, retryable); another webhook's delivery id,
// or a delivery id under another webhook, is 404 and queues nothing. On SQLite and on PostgreSQL (where concurrent
// replays each counting the pending ones could otherwise all pass the bound together).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startReceiver } from "../webhooks/receiver.ts";
import type { Receiver } from "../webhooks/receiver.ts";
import { MAX_PENDING_DELIVERIES_PER_WEBHOOK } from "../../src/webhooks/service.ts";
import { startPostgres } from "../support/postgres.ts";
import type { TestPostgres } from "../support/postgres.ts";

let rx: Receiver;

before(async () => {
  rx = await startReceiver();
});
after(async () => {
  await rx?.close();
});

// Slow retries: a failing delivery stays queued for the test's length.
const env = { KILN_WEBHOOK_ALLOW_PRIVATE: "1", KILN_WEBHOOK_RETRY_SCHEDULE_MS: "0,600000,600000", KILN_WARM_POOL: "0" };

async function withMachine(k: TestKiln): Promise<string> {
  const m = await k.call("POST", "/v1/machines", { body: {} });
  assert.equal(m.status, 201, m.text);
  return m.body.id;
}

async function pendingOf(k: TestKiln, hookId: string): Promise<number> {
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

async function floodAndBurst(k: TestKiln, machineId: string) {
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
  assert.ok((await pendingOf(k, hook.id)) <= MAX_PENDING_DELIVERIES_PER_WEBHOOK, "never more pending than the bound");
  assert.equal((await pendingOf(k, other.id)) <= 1, true, "the other webhook got nothing");
  await k.call("DELETE", `/v1/lifecycle/webhooks/${hook.id}`);
  await k.call("DELETE", `/v1/lifecycle/webhooks/${other.id}`);
}

test("replaying in a loop and in a burst stops at the bound of pending deliveries; other webhooks' delivery ids are 404", async () => {
  const k = await startTestKiln({ env });
  try {
    await floodAndBurst(k, await withMachine(k));
  } finally {
    await k.close();
  }
});

test("on PostgreSQL too, a concurrent burst of replays never passes the bound", async () => {
  let pg: TestPostgres | undefined;
  let k: TestKiln | undefined;
  try {
    pg = await startPostgres();
    k = await startTestKiln({ env: { ...env, KILN_DATABASE_URL: pg.url } });
    await floodAndBurst(k, await withMachine(k));
  } finally {
    await k?.close();
    await pg?.stop();
  }
});
