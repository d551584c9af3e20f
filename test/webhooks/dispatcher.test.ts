// The outbox and the dispatcher on a real store with real receivers (no server, no machines): signatures against
// the standardwebhooks package, the SSRF rules at delivery time, a slow receiver beside a fast one, and an event
// whose transaction rolls back leaving no delivery.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Webhook } from "standardwebhooks";
import { openStore } from "../../src/store/db.ts";
import type { Store } from "../../src/store/db.ts";
import { createLogger } from "../../src/log.ts";
import { newId } from "../../src/store/ids.ts";
import { createDispatcher } from "../../src/webhooks/dispatcher.ts";
import type { DispatcherOptions } from "../../src/webhooks/dispatcher.ts";
import { parseRetryAfter } from "../../src/webhooks/dispatcher.ts";
import { announceDeliveries, enqueueDeliveries, recordEvent } from "../../src/webhooks/outbox.ts";
import { deliveryHeaders, generateSecret, sign } from "../../src/webhooks/signing.ts";
import { addressProblem } from "../../src/webhooks/ssrf.ts";
import { createWebhookService } from "../../src/webhooks/service.ts";
import { pruneWebhookHistory } from "../../src/webhooks/history.ts";
import { startReceiver } from "./receiver.ts";
import type { Receiver } from "./receiver.ts";

let dir: string;
let store: Store;
let rx: Receiver;
const log = createLogger({ level: "silent", pretty: false });

before(async () => {
  dir = await mkdtemp(join(tmpdir(), "kiln-dispatch-"));
  store = await openStore({ dataDir: dir });
  rx = await startReceiver();
});
after(async () => {
  await rx?.close();
  await store?.close();
  await rm(dir, { recursive: true, force: true });
});

function dispatcher(opts: Partial<DispatcherOptions> = {}) {
  return createDispatcher({ db: store.db, dialect: store.dialect, hostId: "host-test", log, scheduleMs: [0], allowPrivate: true, ...opts });
}

function service(allowPrivate: boolean) {
  return createWebhookService({ db: store.db, allowPrivate, rotationGraceMs: 1000, wake: () => undefined });
}

/** Writes an event's deliveries as the machine lifecycle does, then wakes this store's dispatcher. */
async function emit(operation: string, payload: Record<string, unknown> = {}): Promise<string> {
  const id = newId("evt");
  await store.db.transaction().execute((tx) => enqueueDeliveries(tx, { id, operation, occurredAt: new Date().toISOString(), payload: { id, operation, ...payload } }));
  announceDeliveries(store.db);
  return id;
}

async function statusOf(deliveryEventId: string, webhookId: string): Promise<{ status: string; attempts: { error: string | null }[] }> {
  for (let i = 0; i < 400; i++) {
    const row = await store.db.selectFrom("webhook_deliveries").selectAll().where("event_id", "=", deliveryEventId).where("webhook_id", "=", webhookId).executeTakeFirst();
    if (row && (row.status === "succeeded" || row.status === "dead_letter")) {
      const attempts = await store.db.selectFrom("webhook_delivery_attempts").select("error").where("delivery_id", "=", row.id).orderBy("attempt").execute();
      return { status: row.status, attempts };
    }
    await new Promise((r) => setTimeout(r, 20));
  }
  assert.fail("the delivery never finished");
}

test("signatures are Standard Webhooks: the package's own signer agrees, and a non-whsec secret signs as its bytes", () => {
  const secret = generateSecret();
  const ts = 1_700_000_000;
  const body = JSON.stringify({ id: "evt_1", operation: "create" });
  assert.equal(sign(secret, "evt_1", ts, body), new Webhook(secret).sign("evt_1", new Date(ts * 1000), body));
  const raw = "a plain secret of some length";
  assert.equal(sign(raw, "evt_1", ts, body), new Webhook(Buffer.from(raw), { format: "raw" }).sign("evt_1", new Date(ts * 1000), body));
  const headers = deliveryHeaders({ webhookId: "whk_1", deliveryId: "dlv_1", eventId: "evt_1", body, secrets: [secret, raw], timestamp: Math.floor(Date.now() / 1000) });
  assert.equal(headers["x-service-signature"].split(" ").length, 2);
  assert.deepEqual(new Webhook(secret).verify(body, headers), JSON.parse(body));
});

test("receiver addresses: link-local and metadata never, private and loopback only when allowed", () => {
  for (const ip of ["169.254.169.254", "169.254.0.1", "fe80::1", "fd00:ec2::254", "::ffff:169.254.169.254", "0.0.0.0", "::", "224.0.0.1", "100.100.100.200"]) {
    assert.ok(addressProblem(ip, true), `${ip} is refused even with private addresses allowed`);
  }
  for (const ip of ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "::1", "fd12::1", "::ffff:127.0.0.1", "::ffff:7f00:1", "100.64.0.1"]) {
    assert.ok(addressProblem(ip, false), `${ip} is refused by default`);
    assert.equal(addressProblem(ip, true), null, `${ip} is allowed with KILN_WEBHOOK_ALLOW_PRIVATE=1`);
  }
  for (const ip of ["93.184.216.34", "2606:4700::1111", "8.8.8.8"]) assert.equal(addressProblem(ip, false), null, ip);
});

test("Retry-After as seconds or an HTTP date", () => {
  const now = Date.parse("2026-01-01T00:00:00Z");
  assert.equal(parseRetryAfter("3", now), 3000);
  assert.equal(parseRetryAfter("Thu, 01 Jan 2026 00:00:10 GMT", now), 10_000);
  assert.equal(parseRetryAfter("soon", now), 0);
  assert.equal(parseRetryAfter(undefined, now), 0);
});

test("SSRF: a receiver name resolving to loopback is refused at create, as at delivery time, unless private addresses are allowed", async () => {
  const strict = service(false);
  await assert.rejects(strict.create({ url: `${rx.url}/literal`, operations: ["create"] }), /private or loopback \(127\.0\.0\.0\/8\); set KILN_WEBHOOK_ALLOW_PRIVATE=1/);
  const port = new URL(rx.url).port;
  // `localhost` is judged by what it resolves to, with the same message as the literal address.
  await assert.rejects(strict.create({ url: `http://localhost:${port}/by-name`, operations: ["create"] }), /url is not allowed: localhost: the receiver address 127\.0\.0\.1 is private or loopback \(127\.0\.0\.0\/8\); set KILN_WEBHOOK_ALLOW_PRIVATE=1/);
  const hook = await strict.create({ url: `http://no-such-receiver.invalid:${port}/later`, operations: ["create"] }).then(
    async (later) => (await strict.remove(later.id), service(true).create({ url: `http://localhost:${port}/by-name`, operations: ["create"] })),
  );
  const d = dispatcher({ allowPrivate: false });
  await d.start();
  try {
    const evt = await emit("create");
    const done = await statusOf(evt, hook.id);
    assert.equal(done.status, "dead_letter");
    assert.match(done.attempts[0].error ?? "", /^refused: .*private or loopback/);
    assert.equal(rx.received.filter((r) => r.path === "/by-name").length, 0, "no request reached the receiver");
  } finally {
    await d.close();
    await strict.remove(hook.id);
  }
});

test("SSRF: IP-literal receivers are checked at delivery time too (a metadata address even with private addresses allowed)", async () => {
  const loose = service(true);
  const literal = await loose.create({ url: `${rx.url}/literal`, operations: ["resume"] });
  // A row the API would refuse (the store may predate a rule, or be written by hand): the dispatcher refuses it anyway.
  const metadata = await loose.create({ url: `${rx.url}/metadata`, operations: ["resume"] });
  await store.db.updateTable("webhooks").set({ url: "http://169.254.169.254/latest/meta-data/" }).where("id", "=", metadata.id).execute();
  const strict = dispatcher({ allowPrivate: false });
  await strict.start();
  try {
    const evt = await emit("resume");
    const toLoopback = await statusOf(evt, literal.id);
    assert.match(toLoopback.attempts[0].error ?? "", /^refused: .*127\.0\.0\.1 is private or loopback/);
    const toMetadata = await statusOf(evt, metadata.id);
    assert.match(toMetadata.attempts[0].error ?? "", /^refused: .*169\.254\.169\.254 is link-local/);
  } finally {
    await strict.close();
  }
  const permissive = dispatcher({ allowPrivate: true });
  await permissive.start();
  try {
    const evt = await emit("resume");
    assert.match((await statusOf(evt, metadata.id)).attempts[0].error ?? "", /^refused: .*link-local/, "metadata stays refused");
    assert.equal((await statusOf(evt, literal.id)).status, "succeeded");
  } finally {
    await permissive.close();
    await loose.remove(literal.id);
    await loose.remove(metadata.id);
  }
});

test("one slow receiver never holds up the others", async () => {
  const hooks = service(true);
  const slow = await hooks.create({ url: `${rx.url}/slow`, operations: ["update"] });
  const fast = await hooks.create({ url: `${rx.url}/fast`, operations: ["update"] });
  let release!: () => void;
  const held = new Promise<void>((r) => (release = r));
  rx.respond = async (r) => {
    if (r.path === "/slow") await held;
    return { status: 200 };
  };
  const d = dispatcher({ maxPerWebhook: 3, maxInFlight: 8 });
  await d.start();
  try {
    for (let i = 0; i < 30; i++) await emit("update", { n: i });
    await rx.waitForCount((r) => r.path === "/fast", 30);
    assert.equal(rx.received.filter((r) => r.path === "/slow").length, 3, "the slow receiver holds only its own share of requests");
    release();
    await rx.waitForCount((r) => r.path === "/slow", 30);
  } finally {
    release();
    rx.respond = () => ({ status: 200 });
    await d.close();
    await hooks.remove(slow.id);
    await hooks.remove(fast.id);
  }
});

test("an event and its deliveries commit together: a rolled-back transaction leaves neither", async () => {
  const hooks = service(true);
  const w = await hooks.create({ url: `${rx.url}/atomic`, operations: ["destroy"] });
  const id = newId("evt");
  await assert.rejects(
    store.db.transaction().execute(async (tx) => {
      const n = await recordEvent(tx, { id, operation: "destroy", occurredAt: new Date().toISOString(), payload: { id }, machineId: "mch_x" });
      assert.equal(n, 1);
      throw new Error("the state change failed");
    }),
    /state change failed/,
  );
  assert.equal((await store.db.selectFrom("events").select("id").where("id", "=", id).execute()).length, 0);
  assert.equal((await store.db.selectFrom("webhook_deliveries").select("id").where("event_id", "=", id).execute()).length, 0);
  await hooks.remove(w.id);
});

test("a url change checked while the operator's key allowed private addresses is refused, not applied to the widened webhook", async () => {
  // The key holder's new url resolves (slowly) to a public address; meanwhile the operator lets the webhook reach
  // private ones. Landing the url then would hand the operator's grant to a name the key holder controls.
  let release: () => void = () => undefined;
  const held = new Promise<void>((r) => (release = r));
  const slow = createWebhookService({
    db: store.db,
    allowPrivate: false,
    rotationGraceMs: 1000,
    wake: () => undefined,
    resolve: ((_name: string, _o: unknown, cb: (err: Error | null, a: { address: string; family: number }[]) => void) => {
      void held.then(() => cb(null, [{ address: "93.184.216.34", family: 4 }]));
    }) as never,
  });
  const hook = await slow.create({ url: "http://93.184.216.34/hook", operations: ["create"] });
  const moving = slow.update(hook.id, { url: "http://attacker.example/hook" }, { operator: false });
  await slow.update(hook.id, { allow_private: true }, { operator: true });
  release();
  await assert.rejects(moving, (err: { code?: string; message?: string }) => err.code === "conflict" && /changed while this update was checked/.test(err.message ?? ""));
  const after = await slow.get(hook.id);
  assert.equal(after.url, "http://93.184.216.34/hook", "the url the operator's grant was given for");
  assert.equal(after.allow_private, true);
  await slow.remove(hook.id);
});

test("history: finished deliveries past the period go with their attempts and events; queued and recent ones stay", async () => {
  const svc = service(true);
  const hook = await svc.create({ url: `${rx.url}/history`, operations: ["create"] });
  const held = await svc.create({ url: `${rx.url}/held`, operations: ["create"] });
  // Events as the machine lifecycle records them: the `events` row beside its deliveries.
  const emitRecorded = async () => {
    const id = newId("evt");
    await store.db.transaction().execute((tx) => recordEvent(tx, { id, operation: "create", machineId: "mch_history", occurredAt: new Date().toISOString(), payload: { id, operation: "create" } }));
    announceDeliveries(store.db);
    return id;
  };
  const d = dispatcher();
  await d.start();
  let oldEvt = "";
  let newEvt = "";
  try {
    oldEvt = await emitRecorded();
    assert.equal((await statusOf(oldEvt, hook.id)).status, "succeeded");
    await statusOf(oldEvt, held.id);
    newEvt = await emitRecorded();
    assert.equal((await statusOf(newEvt, hook.id)).status, "succeeded");
  } finally {
    await d.close();
  }
  const longAgo = new Date(Date.now() - 40 * 86_400_000).toISOString();
  // The old event and its delivery to one webhook finished 40 days ago; its delivery to the other waits for a retry.
  await store.db.updateTable("events").set({ occurred_at: longAgo }).where("id", "=", oldEvt).execute();
  const later = new Date(Date.now() + 86_400_000).toISOString();
  await store.db.updateTable("webhook_deliveries").set({ status: "queued", completed_at: null, next_attempt_at: later }).where("event_id", "=", oldEvt).where("webhook_id", "=", held.id).execute();
  await store.db.updateTable("webhook_deliveries").set({ completed_at: longAgo }).where("event_id", "=", oldEvt).where("webhook_id", "=", hook.id).execute();
  const deliveryOf = (evt: string, whk: string) => store.db.selectFrom("webhook_deliveries").select(["id", "status"]).where("event_id", "=", evt).where("webhook_id", "=", whk).executeTakeFirst();
  const oldDelivery = (await deliveryOf(oldEvt, hook.id))!.id;

  const pruned = await pruneWebhookHistory(store.db, new Date(Date.now() - 30 * 86_400_000));
  assert.ok(pruned.deliveries >= 1);
  assert.equal(await deliveryOf(oldEvt, hook.id), undefined, "the old finished delivery is gone");
  assert.equal((await store.db.selectFrom("webhook_delivery_attempts").select("delivery_id").where("delivery_id", "=", oldDelivery).execute()).length, 0, "and its attempts");
  assert.equal((await deliveryOf(oldEvt, held.id))?.status, "queued", "a queued delivery of the same event stays");
  assert.ok(await store.db.selectFrom("events").select("id").where("id", "=", oldEvt).executeTakeFirst(), "the event stays while a delivery of it does");
  assert.equal((await deliveryOf(newEvt, hook.id))?.status, "succeeded", "a recent delivery stays");

  // Once nothing of it is left, the old event goes too.
  await svc.remove(held.id);
  assert.ok((await pruneWebhookHistory(store.db, new Date(Date.now() - 30 * 86_400_000))).events >= 1);
  assert.equal(await store.db.selectFrom("events").select("id").where("id", "=", oldEvt).executeTakeFirst(), undefined);
  assert.ok(await store.db.selectFrom("events").select("id").where("id", "=", newEvt).executeTakeFirst(), "a recent event stays");
  await svc.remove(hook.id);
});
