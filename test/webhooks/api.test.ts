// Lifecycle webhooks through the API against a real receiver on loopback: every endpoint and validation rule,
// signed deliveries of real machine events, retries, dead letters, 410, rotation, disabled webhooks, the CLI,
// and the signing secret never leaving the one column that stores it.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createHmac, timingSafeEqual } from "node:crypto";
import { execFile } from "node:child_process";
import { readdir, readFile, stat } from "node:fs/promises";
import { join } from "node:path";
import { promisify } from "node:util";
import { Webhook } from "standardwebhooks";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startReceiver } from "./receiver.ts";
import type { Receiver, Received, Reply } from "./receiver.ts";

const GRACE_MS = 1500;
let k: TestKiln;
let rx: Receiver;
let machineId: string;

before(async () => {
  rx = await startReceiver();
  k = await startTestKiln({
    env: { KILN_WEBHOOK_ALLOW_PRIVATE: "1", KILN_WEBHOOK_RETRY_SCHEDULE_MS: "0,50,50", KILN_WEBHOOK_ROTATION_GRACE_MS: String(GRACE_MS), KILN_WARM_POOL: "0" },
  });
  const m = await k.call("POST", "/v1/machines", { body: {} });
  assert.equal(m.status, 201, m.text);
  machineId = m.body.id;
});
after(async () => {
  await k?.close();
  await rx?.close();
});

/** A webhook on its own receiver path, so each test sees only its own deliveries. */
async function hook(path: string, body: Record<string, unknown> = {}) {
  const res = await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: `${rx.url}/${path}`, operations: ["update"], ...body } });
  assert.equal(res.status, 201, res.text);
  return res.body as { id: string; signing_secret?: string; url: string; operations: string[]; enabled: boolean; allow_private: boolean };
}

/** An `update` lifecycle event of the test machine; resolves with its event id once it is committed. */
let renames = 0;
async function updateEvent(): Promise<void> {
  const res = await k.call("PATCH", `/v1/machines/${machineId}`, { body: { name: `n${++renames}` } });
  assert.equal(res.status, 200, res.text);
}

const onPath = (path: string) => (r: Received) => r.path === `/${path}`;

async function deliveries(hookId: string, query = "") {
  const res = await k.call("GET", `/v1/lifecycle/webhooks/${hookId}/deliveries${query}`);
  assert.equal(res.status, 200, res.text);
  return res.body.deliveries as any[];
}

/** Waits for the delivery's recorded status; the dispatcher writes outcomes right after the receiver answers. */
async function settled(hookId: string, deliveryId: string, status: string) {
  for (let i = 0; i < 400; i++) {
    const d = (await k.call("GET", `/v1/lifecycle/webhooks/${hookId}/deliveries/${deliveryId}`)).body;
    if (d.status === status) return d;
    await new Promise((r) => setTimeout(r, 25));
  }
  assert.fail(`delivery ${deliveryId} never became ${status}`);
}

/** Standard Webhooks, by hand: what a receiver without the library writes. */
function verifyByHand(secret: string, headers: Received["headers"], body: string): boolean {
  const key = secret.startsWith("whsec_") ? Buffer.from(secret.slice(6), "base64") : Buffer.from(secret);
  const content = `${headers["x-service-event-id"]}.${headers["x-service-timestamp"]}.${body}`;
  const expected = Buffer.from(createHmac("sha256", key).update(content).digest("base64"));
  if (Math.abs(Date.now() / 1000 - Number(headers["x-service-timestamp"])) > 300) return false;
  return String(headers["x-service-signature"])
    .split(" ")
    .some((s) => s.startsWith("v1,") && Buffer.from(s.slice(3)).length === expected.length && timingSafeEqual(Buffer.from(s.slice(3)), expected));
}

test("create, get, list by pages, patch and delete a webhook; records never show the signing secret", async () => {
  const a = await hook("crud-a", { operations: ["create", "destroy"] });
  assert.match(a.id, /^whk_/);
  assert.match(a.signing_secret!, /^whsec_[A-Za-z0-9+/]+={0,2}$/);
  assert.ok(Buffer.from(a.signing_secret!.slice(6), "base64").length >= 24, "a generated secret holds 24+ random bytes");
  assert.deepEqual(Object.keys(a).sort(), ["allow_private", "created_at", "enabled", "id", "operations", "signing_secret", "updated_at", "url"]);
  assert.equal(a.allow_private, false);
  assert.equal(a.enabled, true);
  assert.deepEqual(a.operations, ["create", "destroy"]);

  const given = await hook("crud-b", { signing_secret: "a-secret-of-my-own-choosing" });
  assert.equal(given.signing_secret, undefined, "a secret the client chose is not echoed back");
  const c = await hook("crud-c");

  const got = await k.call("GET", `/v1/lifecycle/webhooks/${a.id}`);
  assert.equal(got.status, 200);
  assert.deepEqual(Object.keys(got.body).sort(), ["allow_private", "created_at", "enabled", "id", "operations", "updated_at", "url"]);

  const first = await k.call("GET", "/v1/lifecycle/webhooks?limit=2");
  assert.equal(first.status, 200);
  assert.equal(first.body.webhooks.length, 2);
  assert.deepEqual(first.body.webhooks.map((w: { id: string }) => w.id), [c.id, given.id], "newest first");
  const second = await k.call("GET", `/v1/lifecycle/webhooks?limit=2&cursor=${first.body.next_cursor}`);
  assert.ok(second.body.webhooks.some((w: { id: string }) => w.id === a.id));
  for (const w of [...first.body.webhooks, ...second.body.webhooks]) assert.equal(w.signing_secret, undefined);

  const patched = await k.call("PATCH", `/v1/lifecycle/webhooks/${a.id}`, { body: { url: `${rx.url}/crud-a2`, operations: ["hibernate"], enabled: false, signing_secret: "whsec_" + Buffer.alloc(32, 7).toString("base64") } });
  assert.equal(patched.status, 200, patched.text);
  assert.equal(patched.body.url, `${rx.url}/crud-a2`);
  assert.deepEqual(patched.body.operations, ["hibernate"]);
  assert.equal(patched.body.enabled, false);
  assert.equal(patched.body.signing_secret, undefined);
  assert.ok(patched.body.updated_at >= patched.body.created_at);

  for (const w of [a, given, c]) {
    const del = await k.call("DELETE", `/v1/lifecycle/webhooks/${w.id}`);
    assert.equal(del.status, 200);
    assert.deepEqual(del.body, { id: w.id, deleted: true });
  }
  assert.equal((await k.call("GET", `/v1/lifecycle/webhooks/${a.id}`)).body.code, "not_found");
  assert.equal((await k.call("DELETE", `/v1/lifecycle/webhooks/${a.id}`)).status, 404);
  assert.equal((await k.call("PATCH", `/v1/lifecycle/webhooks/${a.id}`, { body: { enabled: true } })).status, 404);
  assert.equal((await k.call("GET", `/v1/lifecycle/webhooks/${a.id}/deliveries`)).status, 404);
  assert.equal((await k.call("GET", "/v1/lifecycle/webhooks", { key: null })).body.code, "unauthorized");
});

test("bad webhook input is refused with invalid_request and changes nothing", async () => {
  const before = (await k.call("GET", "/v1/lifecycle/webhooks?limit=100")).body.webhooks.length;
  const bad: [string, unknown][] = [
    ["unknown operation", { url: `${rx.url}/x`, operations: ["explode"] }],
    ["no operations", { url: `${rx.url}/x`, operations: [] }],
    ["operations not an array", { url: `${rx.url}/x`, operations: { create: true } }],
    ["ftp URL", { url: "ftp://example.com/hook", operations: ["create"] }],
    ["file URL", { url: "file:///etc/passwd", operations: ["create"] }],
    ["not a URL", { url: "receiver", operations: ["create"] }],
    ["credentials in the URL", { url: "https://user:pw@example.com/hook", operations: ["create"] }],
    ["user only in the URL", { url: "https://user@example.com/hook", operations: ["create"] }],
    ["metadata address", { url: "http://169.254.169.254/latest/meta-data", operations: ["create"] }],
    ["metadata address, IPv4-mapped IPv6", { url: "http://[::ffff:169.254.169.254]/", operations: ["create"] }],
    ["link-local IPv6", { url: "http://[fe80::1]/", operations: ["create"] }],
    ["missing url", { operations: ["create"] }],
    ["unknown field", { url: `${rx.url}/x`, operations: ["create"], secret: "x" }],
    ["short secret", { url: `${rx.url}/x`, operations: ["create"], signing_secret: "short" }],
    ["whsec_ secret that is not base64", { url: `${rx.url}/x`, operations: ["create"], signing_secret: "whsec_not*base64!!" }],
    ["whsec_ secret too small", { url: `${rx.url}/x`, operations: ["create"], signing_secret: "whsec_" + Buffer.alloc(8).toString("base64") }],
  ];
  for (const [why, body] of bad) {
    const res = await k.call("POST", "/v1/lifecycle/webhooks", { body });
    assert.equal(res.status, 400, `${why}: ${res.text}`);
    assert.equal(res.body.code, "invalid_request", why);
    assert.ok(res.body.request_id, why);
  }
  const w = await hook("validation");
  for (const [why, body] of [
    ["empty patch", {}],
    ["unknown operation", { operations: ["create", "nope"] }],
    ["enabled not a boolean", { enabled: "yes" }],
    ["credentials", { url: "http://a:b@example.com/" }],
    ["javascript URL", { url: "javascript:alert(1)" }],
  ] as [string, unknown][]) {
    const res = await k.call("PATCH", `/v1/lifecycle/webhooks/${w.id}`, { body });
    assert.equal(res.status, 400, `${why}: ${res.text}`);
  }
  assert.deepEqual((await k.call("GET", `/v1/lifecycle/webhooks/${w.id}`)).body.operations, ["update"], "a refused patch changed nothing");
  for (const q of ["limit=0", "limit=101", "limit=x", "cursor=bm9wZQ", "status=lost"]) {
    assert.equal((await k.call("GET", `/v1/lifecycle/webhooks/${w.id}/deliveries?${q}`)).status, 400, q);
  }
  assert.equal((await k.call("GET", "/v1/lifecycle/webhooks?cursor=garbage")).status, 400);
  assert.equal((await k.call("GET", `/v1/lifecycle/webhooks/${w.id}/deliveries/dlv_nothing`)).status, 404);
  assert.equal((await k.call("POST", `/v1/lifecycle/webhooks/${w.id}/deliveries/dlv_nothing/retry`)).status, 404);
  await k.call("DELETE", `/v1/lifecycle/webhooks/${w.id}`);
  assert.equal((await k.call("GET", "/v1/lifecycle/webhooks?limit=100")).body.webhooks.length, before);
});

test("a machine create and destroy produce signed deliveries that verify with the standardwebhooks package", async () => {
  const w = await hook("lifecycle", { operations: ["create", "destroy"] });
  const m = await k.call("POST", "/v1/machines", { body: {} });
  assert.equal(m.status, 201, m.text);
  assert.equal((await k.call("DELETE", `/v1/machines/${m.body.id}`)).status, 200);
  const [created, destroyed] = await rx.waitForCount(onPath("lifecycle"), 2);
  const verifier = new Webhook(w.signing_secret!);
  for (const [r, op, status] of [[created, "create", "running"], [destroyed, "destroy", "destroyed"]] as const) {
    const payload = verifier.verify(r.body, r.headers as Record<string, string>) as any;
    assert.equal(payload.operation, op);
    assert.match(payload.id, /^evt_/);
    assert.equal(payload.machine.id, m.body.id);
    assert.equal(payload.machine.status, status);
    assert.ok(Date.parse(payload.occurred_at));
    assert.equal(r.headers["x-service-webhook-id"], w.id);
    assert.match(String(r.headers["x-service-delivery-id"]), /^dlv_/);
    assert.equal(r.headers["x-service-event-id"], payload.id);
    assert.equal(r.headers["webhook-id"], payload.id);
    assert.equal(r.headers["x-service-signature-version"], "v1");
    assert.equal(r.headers["x-service-signature"], r.headers["webhook-signature"]);
    assert.equal(r.headers["x-service-timestamp"], r.headers["webhook-timestamp"]);
    assert.equal(r.headers["content-type"], "application/json");
    assert.ok(verifyByHand(w.signing_secret!, r.headers, r.body), "a ten-line hand-written verifier agrees");
    assert.ok(!verifyByHand(w.signing_secret!, r.headers, r.body.replace("machine", "mach1ne")), "a changed body does not verify");
  }
  assert.throws(() => new Webhook("whsec_" + Buffer.alloc(32, 1).toString("base64")).verify(created.body, created.headers as Record<string, string>), "another secret does not verify");
  const listed = await deliveries(w.id);
  assert.equal(listed.length, 2);
  const detail = await settled(w.id, String(created.headers["x-service-delivery-id"]), "succeeded");
  assert.equal(detail.operation, "create");
  assert.equal(detail.attempts.length, 1);
  assert.equal(detail.attempts[0].status_code, 200);
  assert.equal(detail.attempts[0].attempt, 1);
  assert.equal(detail.attempts[0].response_excerpt, "ok");
  assert.equal(detail.payload.id, created.headers["x-service-event-id"]);
  assert.equal((await deliveries(w.id, "?status=succeeded")).length, 2);
  assert.equal((await deliveries(w.id, "?status=dead_letter")).length, 0);
  const page = await k.call("GET", `/v1/lifecycle/webhooks/${w.id}/deliveries?limit=1`);
  assert.equal(page.body.deliveries[0].operation, "destroy", "newest first");
  const rest = await k.call("GET", `/v1/lifecycle/webhooks/${w.id}/deliveries?limit=1&cursor=${page.body.next_cursor}`);
  assert.equal(rest.body.deliveries[0].operation, "create");
  assert.equal(rest.body.next_cursor, null);
  await k.call("DELETE", `/v1/lifecycle/webhooks/${w.id}`);
});

test("a receiver that fails twice then recovers gets the same event a third time, and it ends succeeded", async () => {
  const w = await hook("flaky");
  let calls = 0;
  rx.respond = (r) => (r.path === "/flaky" && ++calls <= 2 ? { status: 500, body: "down for a moment" } : { status: 200, body: "ok" });
  await updateEvent();
  const got = await rx.waitForCount(onPath("flaky"), 3);
  assert.equal(new Set(got.map((r) => r.headers["x-service-event-id"])).size, 1, "every attempt carries the same event id");
  assert.equal(new Set(got.map((r) => r.headers["x-service-delivery-id"])).size, 1);
  for (const r of got) assert.ok(new Webhook(w.signing_secret!).verify(r.body, r.headers as Record<string, string>));
  const d = await settled(w.id, String(got[0].headers["x-service-delivery-id"]), "succeeded");
  assert.deepEqual(d.attempts.map((a: any) => a.status_code), [500, 500, 200]);
  assert.deepEqual(d.attempts.map((a: any) => a.attempt), [1, 2, 3]);
  assert.equal(d.attempts[0].response_excerpt, "down for a moment");
  assert.match(d.attempts[0].error, /500/);
  assert.equal(d.attempts[2].error, null);
  rx.respond = () => ({ status: 200, body: "ok" });
  await k.call("DELETE", `/v1/lifecycle/webhooks/${w.id}`);
});

test("a receiver that always fails ends dead_letter with every attempt recorded, and retry queues it again", async () => {
  const w = await hook("broken");
  rx.respond = (r) => (r.path === "/broken" ? { status: 503, body: "x".repeat(100_000) } : { status: 200 });
  await updateEvent();
  const got = await rx.waitForCount(onPath("broken"), 3);
  const id = String(got[0].headers["x-service-delivery-id"]);
  const d = await settled(w.id, id, "dead_letter");
  assert.equal(d.attempts.length, 3, "the schedule (0,50,50 ms) allows three attempts");
  for (const a of d.attempts) {
    assert.equal(a.status_code, 503);
    assert.ok(a.duration_ms >= 0);
    assert.ok(Date.parse(a.started_at));
    assert.ok(a.response_excerpt.length <= 512, "only an excerpt of the response is kept");
  }
  assert.equal(d.next_attempt_at, null);
  assert.ok(d.completed_at);
  assert.equal((await deliveries(w.id, "?status=dead_letter")).length, 1);
  const early = await k.call("POST", `/v1/lifecycle/webhooks/${w.id}/deliveries/${id}/retry`);
  assert.equal(early.status, 200, early.text);
  assert.equal(early.body.status, "queued");
  rx.respond = () => ({ status: 204 });
  await rx.waitForCount(onPath("broken"), 4);
  const done = await settled(w.id, id, "succeeded");
  assert.deepEqual(done.attempts.map((a: any) => a.status_code), [503, 503, 503, 204]);
  const again = await k.call("POST", `/v1/lifecycle/webhooks/${w.id}/deliveries/${id}/retry`);
  assert.equal(again.status, 409, "only a dead letter can be retried");
  assert.equal(again.body.code, "conflict");
  rx.respond = () => ({ status: 200, body: "ok" });
  await k.call("DELETE", `/v1/lifecycle/webhooks/${w.id}`);
});

test("replay sends a delivery's event again as a new delivery (also one that succeeded): same event id and payload, a new delivery id, signed anew", async () => {
  const w = await hook("replay");
  rx.respond = () => ({ status: 200, body: "ok" });
  await updateEvent();
  const [first] = await rx.waitForCount(onPath("replay"), 1);
  const originalId = String(first.headers["x-service-delivery-id"]);
  const original = await settled(w.id, originalId, "succeeded");

  const replayed = await k.call("POST", `/v1/lifecycle/webhooks/${w.id}/deliveries/${originalId}/replay`);
  assert.equal(replayed.status, 202, replayed.text);
  assert.match(replayed.body.id, /^dlv_/);
  assert.notEqual(replayed.body.id, originalId);
  assert.deepEqual(
    { webhook_id: replayed.body.webhook_id, event_id: replayed.body.event_id, operation: replayed.body.operation, attempts: replayed.body.attempts },
    { webhook_id: w.id, event_id: original.event_id, operation: "update", attempts: [] },
  );
  assert.ok(["queued", "in_progress", "succeeded"].includes(replayed.body.status), replayed.body.status);

  const [, second] = await rx.waitForCount(onPath("replay"), 2);
  assert.equal(second.headers["x-service-delivery-id"], replayed.body.id);
  assert.equal(second.headers["x-service-event-id"], original.event_id);
  assert.equal(second.body, first.body, "the payload is the event as it was first sent");
  assert.ok(verifyByHand(w.signing_secret!, second.headers, second.body), "signed with the webhook's secret");
  const done = await settled(w.id, replayed.body.id, "succeeded");
  assert.equal(done.attempts.length, 1);
  assert.deepEqual((await settled(w.id, originalId, "succeeded")).attempts, original.attempts, "the original delivery is unchanged");
  assert.deepEqual((await deliveries(w.id)).map((d) => d.id).slice(0, 2), [replayed.body.id, originalId], "the replay is listed, newest first");

  // A dead letter can be replayed too; unknown ids are 404; a disabled webhook refuses (its deliveries would wait).
  assert.equal((await k.call("POST", `/v1/lifecycle/webhooks/${w.id}/deliveries/dlv_nothing/replay`)).status, 404);
  assert.equal((await k.call("POST", `/v1/lifecycle/webhooks/whk_nothing/deliveries/${originalId}/replay`)).status, 404);
  const other = await hook("replay-other");
  assert.equal((await k.call("POST", `/v1/lifecycle/webhooks/${other.id}/deliveries/${originalId}/replay`)).status, 404, "a delivery is replayed only through its own webhook");
  await k.call("PATCH", `/v1/lifecycle/webhooks/${w.id}`, { body: { enabled: false } });
  const disabled = await k.call("POST", `/v1/lifecycle/webhooks/${w.id}/deliveries/${originalId}/replay`);
  assert.equal(disabled.status, 409, disabled.text);
  assert.equal(disabled.body.code, "conflict");
  assert.equal((await deliveries(w.id)).length, 2, "a refused replay adds no delivery");
  await k.call("DELETE", `/v1/lifecycle/webhooks/${w.id}`);
  await k.call("DELETE", `/v1/lifecycle/webhooks/${other.id}`);
});

test("410 Gone disables the webhook and ends the delivery; a disabled webhook receives nothing", async () => {
  const gone = await hook("gone");
  const witness = await hook("witness");
  rx.respond = (r) => (r.path === "/gone" ? { status: 410 } : { status: 200 });
  await updateEvent();
  const [first] = await rx.waitForCount(onPath("gone"), 1);
  const d = await settled(gone.id, String(first.headers["x-service-delivery-id"]), "dead_letter");
  assert.equal(d.attempts.length, 1, "no retries after 410");
  assert.equal(d.attempts[0].status_code, 410);
  assert.equal((await k.call("GET", `/v1/lifecycle/webhooks/${gone.id}`)).body.enabled, false);

  // Another event: the witness gets it; the disabled webhook gets no delivery at all.
  await updateEvent();
  await rx.waitForCount(onPath("witness"), 2);
  assert.equal((await deliveries(gone.id)).length, 1);
  assert.equal(rx.received.filter(onPath("gone")).length, 1);

  // Disabled by PATCH: the same.
  const off = await k.call("PATCH", `/v1/lifecycle/webhooks/${witness.id}`, { body: { enabled: false } });
  assert.equal(off.body.enabled, false);
  const third = await hook("third");
  await updateEvent();
  await rx.waitForCount(onPath("third"), 1);
  assert.equal(rx.received.filter(onPath("witness")).length, 2, "the disabled webhook received nothing");
  assert.equal((await deliveries(witness.id)).length, 2);
  rx.respond = () => ({ status: 200, body: "ok" });
  for (const w of [gone, witness, third]) await k.call("DELETE", `/v1/lifecycle/webhooks/${w.id}`);
});

test("rotation: both signatures while the old secret is in grace, only the new one after", async () => {
  const w = await hook("rotate");
  const oldSecret = w.signing_secret!;
  const newSecret = "whsec_" + Buffer.alloc(32, 42).toString("base64");
  const rotated = await k.call("PATCH", `/v1/lifecycle/webhooks/${w.id}`, { body: { signing_secret: newSecret } });
  assert.equal(rotated.status, 200);
  const rotatedAt = Date.now();
  await updateEvent();
  const [during] = await rx.waitForCount(onPath("rotate"), 1);
  const sigs = String(during.headers["x-service-signature"]).split(" ");
  assert.equal(sigs.length, 2, "two signatures in grace");
  assert.equal(during.headers["webhook-signature"], during.headers["x-service-signature"]);
  assert.ok(new Webhook(newSecret).verify(during.body, during.headers as Record<string, string>));
  assert.ok(new Webhook(oldSecret).verify(during.body, during.headers as Record<string, string>), "receivers still on the old secret verify");
  assert.ok(verifyByHand(newSecret, during.headers, during.body) && verifyByHand(oldSecret, during.headers, during.body));

  // The grace period is a wall-clock deadline (KILN_WEBHOOK_ROTATION_GRACE_MS for this server); wait it out.
  await new Promise((r) => setTimeout(r, Math.max(0, rotatedAt + GRACE_MS + 100 - Date.now())));
  await updateEvent();
  const [afterGrace] = (await rx.waitForCount(onPath("rotate"), 2)).slice(1);
  assert.equal(String(afterGrace.headers["x-service-signature"]).split(" ").length, 1);
  assert.ok(new Webhook(newSecret).verify(afterGrace.body, afterGrace.headers as Record<string, string>));
  assert.throws(() => new Webhook(oldSecret).verify(afterGrace.body, afterGrace.headers as Record<string, string>));
  await k.call("DELETE", `/v1/lifecycle/webhooks/${w.id}`);
});

test("Retry-After is honoured and redirects are not followed (3xx is a failure)", async () => {
  const w = await hook("later");
  let calls = 0;
  rx.respond = (r): Reply => {
    if (r.path === "/later" && ++calls === 1) return { status: 429, headers: { "retry-after": "1" } };
    if (r.path === "/redirect") return { status: 302, headers: { location: `${rx.url}/elsewhere` } };
    return { status: 200 };
  };
  await updateEvent();
  const [a, b] = await rx.waitForCount(onPath("later"), 2);
  assert.ok(b.at - a.at >= 950, `the second attempt waited for Retry-After (${Math.round(b.at - a.at)} ms, schedule says 50)`);
  await k.call("DELETE", `/v1/lifecycle/webhooks/${w.id}`);

  const r = await hook("redirect");
  await updateEvent();
  const got = await rx.waitForCount(onPath("redirect"), 3);
  const d = await settled(r.id, String(got[0].headers["x-service-delivery-id"]), "dead_letter");
  assert.deepEqual(d.attempts.map((x: any) => x.status_code), [302, 302, 302]);
  assert.match(d.attempts[0].error, /redirects are not followed/);
  assert.equal(rx.received.filter(onPath("elsewhere")).length, 0);
  rx.respond = () => ({ status: 200, body: "ok" });
  await k.call("DELETE", `/v1/lifecycle/webhooks/${r.id}`);
});

test("deleting a webhook stops its pending deliveries", async () => {
  const w = await hook("deleted");
  let release!: () => void;
  const held = new Promise<void>((r) => (release = r));
  rx.respond = async (r) => {
    if (r.path === "/deleted") {
      await held;
      return { status: 500 };
    }
    return { status: 200 };
  };
  await updateEvent();
  await rx.waitFor(onPath("deleted"));
  assert.equal((await k.call("DELETE", `/v1/lifecycle/webhooks/${w.id}`)).status, 200);
  const witness = await hook("after-delete");
  release();
  await updateEvent();
  await rx.waitFor(onPath("after-delete"));
  assert.equal(rx.received.filter(onPath("deleted")).length, 1, "no retry after the webhook was deleted");
  const rows = await k.kiln.services.store.db.selectFrom("webhook_deliveries").select("id").where("webhook_id", "=", w.id).execute();
  assert.equal(rows.length, 0);
  rx.respond = () => ({ status: 200, body: "ok" });
  await k.call("DELETE", `/v1/lifecycle/webhooks/${witness.id}`);
});

test("kiln webhooks create, ls, get, deliveries, retry, replay and rm drive the API", async () => {
  const run = promisify(execFile);
  const cli = (args: string[]) => run(join(import.meta.dirname, "..", "..", "bin", "kiln"), args, { env: { ...process.env, KILN_URL: k.url, KILN_API_KEY: TEST_KEY } });
  const made = await cli(["webhooks", "create", `${rx.url}/cli`, "-o", "update"]);
  const [id, secret] = made.stdout.trim().split("\n");
  assert.match(id, /^whk_/);
  assert.match(secret, /^whsec_/);
  assert.match((await cli(["webhooks", "ls"])).stdout, new RegExp(`${id}\tenabled\tupdate\t${rx.url}/cli`));
  assert.equal(JSON.parse((await cli(["webhooks", "get", id])).stdout).id, id);
  rx.respond = (r) => (r.path === "/cli" ? { status: 500 } : { status: 200 });
  await updateEvent();
  const got = await rx.waitForCount(onPath("cli"), 3);
  const deliveryId = String(got[0].headers["x-service-delivery-id"]);
  await settled(id, deliveryId, "dead_letter");
  assert.match((await cli(["webhooks", "deliveries", id, "--status", "dead_letter"])).stdout, new RegExp(`${deliveryId}\tdead_letter\tupdate\tevt_\\w+\t3 attempt\\(s\\)\t500`));
  assert.equal(JSON.parse((await cli(["webhooks", "deliveries", id, deliveryId])).stdout).attempts.length, 3);
  rx.respond = () => ({ status: 200, body: "ok" });
  assert.match((await cli(["webhooks", "retry", id, deliveryId])).stdout, new RegExp(`${deliveryId} queued`));
  await settled(id, deliveryId, "succeeded");
  const replay = (await cli(["webhooks", "replay", id, deliveryId])).stdout;
  const [replayId] = replay.trim().split(" ");
  assert.match(replay, /^dlv_\w+ (queued|in_progress|succeeded)\n$/);
  assert.notEqual(replayId, deliveryId);
  await settled(id, replayId, "succeeded");
  await assert.rejects(cli(["webhooks", "create", "ftp://example.com", "-o", "update"]), (err: { stderr?: string }) => /invalid_request/.test(err.stderr ?? ""));
  assert.match((await cli(["webhooks", "rm", id])).stdout, /deleted/);
});

test("a signing secret never reaches a response, log line, event, delivery or file other than its one column", async () => {
  const marker = `kiln-secret-marker-${process.pid}-${Date.now()}`;
  const created = await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: `${rx.url}/secret`, operations: ["update"], signing_secret: marker } });
  assert.equal(created.status, 201);
  const rotatedMarker = `${marker}-rotated`;
  const responses = [created.text];
  responses.push((await k.call("PATCH", `/v1/lifecycle/webhooks/${created.body.id}`, { body: { signing_secret: rotatedMarker } })).text);
  responses.push((await k.call("PATCH", `/v1/lifecycle/webhooks/${created.body.id}`, { body: { signing_secret: `${marker}-x`, operations: ["bogus"] } })).text);
  responses.push((await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: "ftp://nope", operations: ["update"], signing_secret: marker } })).text);
  responses.push((await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: `${rx.url}/x`, operations: ["update"], signing_secret: "whsec_" + marker } })).text);
  responses.push((await k.call("GET", `/v1/lifecycle/webhooks/${created.body.id}`)).text);
  responses.push((await k.call("GET", "/v1/lifecycle/webhooks?limit=100")).text);
  await updateEvent();
  const [r] = await rx.waitForCount(onPath("secret"), 1);
  assert.ok(verifyByHand(rotatedMarker, r.headers, r.body) && verifyByHand(marker, r.headers, r.body), "a non-whsec secret signs as its UTF-8 bytes");
  assert.ok(new Webhook(Buffer.from(rotatedMarker), { format: "raw" }).verify(r.body, r.headers as Record<string, string>));
  await settled(created.body.id, String(r.headers["x-service-delivery-id"]), "succeeded");
  responses.push((await k.call("GET", `/v1/lifecycle/webhooks/${created.body.id}/deliveries`)).text);
  responses.push((await k.call("GET", `/v1/lifecycle/webhooks/${created.body.id}/deliveries/${r.headers["x-service-delivery-id"]}`)).text);
  for (const text of responses) assert.ok(!text.includes(marker), `a response showed the secret: ${text.slice(0, 200)}`);
  assert.ok(!r.body.includes(marker) && !JSON.stringify(r.headers).includes(marker), "the delivery carries no secret");
  assert.ok(!k.logs.join("").includes(marker), "no log line holds the secret");

  // In the store: only webhooks.signing_secret / previous_signing_secret hold it.
  const db = k.kiln.services.store.db;
  const json = JSON.stringify([
    await db.selectFrom("events").selectAll().execute(),
    await db.selectFrom("webhook_deliveries").selectAll().execute(),
    await db.selectFrom("webhook_delivery_attempts").selectAll().execute(),
    await db.selectFrom("machines").selectAll().execute(),
  ]);
  assert.ok(!json.includes(marker));
  const stored = await db.selectFrom("webhooks").select(["signing_secret", "previous_signing_secret", "url"]).where("id", "=", created.body.id).executeTakeFirstOrThrow();
  assert.deepEqual([stored.signing_secret, stored.previous_signing_secret], [rotatedMarker, marker]);
  // Every file of the data dir other than the store itself.
  const files: string[] = [];
  async function walk(dir: string) {
    for (const e of await readdir(dir, { withFileTypes: true })) {
      const p = join(dir, e.name);
      // A machine's root file system is the machine's, not Kiln's records.
      if (e.isDirectory() && !["rootfs", "upper", "work"].includes(e.name)) await walk(p).catch(() => undefined);
      else if (e.isFile() && !/^kiln\.db(-wal|-shm)?$/.test(e.name) && (await stat(p)).size < 8 * 1024 * 1024) files.push(p);
    }
  }
  await walk(k.dataDir);
  for (const f of files) assert.ok(!(await readFile(f).catch(() => Buffer.alloc(0))).includes(marker), `${f} holds the secret`);
  await k.call("DELETE", `/v1/lifecycle/webhooks/${created.body.id}`);
});
