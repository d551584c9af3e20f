// Private receivers without a restart (issue 24, item 5): the operator's key lets one webhook reach private and
// loopback receivers (`allow_private`), other keys cannot, and a delivery that was refused only for its address goes
// again as soon as that changes — not at its next scheduled retry 5 minutes later. A real receiver on loopback; the
// server first runs with KILN_WEBHOOK_ALLOW_PRIVATE=1, then restarts on the same data dir without it.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { join } from "node:path";
import { promisify } from "node:util";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startReceiver } from "./receiver.ts";
import type { Receiver } from "./receiver.ts";

const FIVE_MINUTES = "0,300000";
const run = promisify(execFile);
const KILN = join(import.meta.dirname, "..", "..", "bin", "kiln");
let k: TestKiln;
let rx: Receiver;
let otherKey: string;
let machineId: string;
let hookId: string;
let deadHookId: string;

before(async () => {
  rx = await startReceiver();
  // A first run that allows private receivers everywhere registers one on loopback.
  const first = await startTestKiln({ env: { KILN_WEBHOOK_ALLOW_PRIVATE: "1", KILN_WEBHOOK_RETRY_SCHEDULE_MS: FIVE_MINUTES, KILN_WARM_POOL: "0" } });
  const made = await first.call("POST", "/v1/lifecycle/webhooks", { body: { url: `${rx.url}/hook`, operations: ["update"] } });
  assert.equal(made.status, 201, made.text);
  assert.equal(made.body.allow_private, false);
  hookId = made.body.id;
  const dead = await first.call("POST", "/v1/lifecycle/webhooks", { body: { url: `${rx.url}/dead`, operations: ["update"] } });
  assert.equal(dead.status, 201, dead.text);
  deadHookId = dead.body.id;
  await first.stop();
  // The operator turns the setting off again (a restart, as before this change).
  k = await startTestKiln({ dataDir: first.dataDir, env: { KILN_WEBHOOK_RETRY_SCHEDULE_MS: FIVE_MINUTES, KILN_WARM_POOL: "0" } });
  const key = await k.call("POST", "/v1/keys", { body: { name: "not the operator" } });
  assert.equal(key.status, 201, key.text);
  otherKey = key.body.key;
  const m = await k.call("POST", "/v1/machines", { body: {} });
  assert.equal(m.status, 201, m.text);
  machineId = m.body.id;
});
after(async () => {
  await k?.close();
  await rx?.close();
});

async function deliveries(id: string) {
  const res = await k.call("GET", `/v1/lifecycle/webhooks/${id}/deliveries`);
  assert.equal(res.status, 200, res.text);
  return res.body.deliveries as any[];
}

async function until<T>(what: string, fn: () => Promise<T | undefined>, timeoutMs = 30_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    const v = await fn();
    if (v !== undefined) return v;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.fail(`${what}: not within ${timeoutMs} ms`);
}

test("a delivery refused for its private receiver goes again at once when the operator's key sets allow_private", async () => {
  const renamed = await k.call("PATCH", `/v1/machines/${machineId}`, { body: { name: "refused-first" } });
  assert.equal(renamed.status, 200, renamed.text);
  const refused = await until("the first attempt is refused", async () =>
    (await deliveries(hookId)).find((d) => d.status === "queued" && d.attempts.length === 1 && /^refused: /.test(d.last_error ?? "")),
  );
  assert.match(refused.last_error, /allow_private: true on the webhook with the operator's key/);
  assert.ok(Date.parse(refused.next_attempt_at) - Date.now() > 60_000, "its next retry is minutes away");

  // Another key may not open the host's network to a webhook.
  const denied = await k.call("PATCH", `/v1/lifecycle/webhooks/${hookId}`, { key: otherKey, body: { allow_private: true } });
  assert.equal(denied.status, 403, denied.text);
  assert.equal(denied.body.code, "forbidden");
  assert.equal(rx.received.length, 0);

  const t0 = Date.now();
  const allowed = await k.call("PATCH", `/v1/lifecycle/webhooks/${hookId}`, { key: TEST_KEY, body: { allow_private: true } });
  assert.equal(allowed.status, 200, allowed.text);
  assert.equal(allowed.body.allow_private, true);
  const got = await rx.waitFor((r) => r.path === "/hook", 30_000);
  assert.ok(got.at - t0 < 30_000, `delivered ${got.at - t0} ms after the change`);
  assert.equal(JSON.parse(got.body).operation, "update");
  const done = await until("the delivery is recorded succeeded", async () => (await deliveries(hookId)).find((d) => d.id === refused.id && d.status === "succeeded"));
  assert.equal(done.attempts.length, 2);

  // New events of that webhook reach the loopback receiver from now on, on this server without KILN_WEBHOOK_ALLOW_PRIVATE.
  await k.call("PATCH", `/v1/machines/${machineId}`, { body: { name: "allowed-next" } });
  await rx.waitForCount((r) => r.path === "/hook", 2, 30_000);
});

test("a dead-lettered delivery refused for its address is queued again when allow_private is set", async () => {
  // The same data dir again, now with a schedule of one attempt: a refused delivery is a dead letter at once.
  const dataDir = k.dataDir;
  await k.stop();
  k = await startTestKiln({ dataDir, env: { KILN_WEBHOOK_RETRY_SCHEDULE_MS: "0", KILN_WARM_POOL: "0" } });
  const renamed = await k.call("PATCH", `/v1/machines/${machineId}`, { body: { name: "dead-letter" } });
  assert.equal(renamed.status, 200, renamed.text);
  const dead = await until("the delivery to /dead is a dead letter", async () => (await deliveries(deadHookId)).find((d) => d.status === "dead_letter"));
  assert.match(dead.last_error, /^refused: /);
  const t0 = Date.now();
  // As a person does it: the CLI with the operator's key.
  const cli = await run(KILN, ["webhooks", "update", deadHookId, "--allow-private"], { env: { ...process.env, KILN_URL: k.url, KILN_API_KEY: TEST_KEY } });
  assert.match(cli.stdout, new RegExp(`^${deadHookId}\t.*/dead\tenabled\tprivate receivers allowed$`, "m"));
  const got = await rx.waitFor((r) => r.path === "/dead", 30_000);
  assert.ok(got.at - t0 < 30_000);
  const done = await until("recorded succeeded", async () => (await deliveries(deadHookId)).find((d) => d.id === dead.id && d.status === "succeeded"));
  assert.equal(done.attempts.length, 2);
});

test("allow_private is the operator's: other keys cannot set it at create, nor move such a webhook's url; turning it off is checked like a create", async () => {
  const asOther = await k.call("POST", "/v1/lifecycle/webhooks", { key: otherKey, body: { url: `${rx.url}/other`, operations: ["update"], allow_private: true } });
  assert.equal(asOther.status, 403, asOther.text);
  assert.match(asOther.body.error, /operator's key/);
  const plain = await k.call("POST", "/v1/lifecycle/webhooks", { key: otherKey, body: { url: `http://localhost:${new URL(rx.url).port}/other`, operations: ["update"] } });
  assert.equal(plain.status, 400, plain.text);
  assert.match(plain.body.error, /localhost: the receiver address 127\.0\.0\.1 is private or loopback.*allow_private: true on the webhook with the operator's key/);

  const op = await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: `http://localhost:${new URL(rx.url).port}/op`, operations: ["update"], allow_private: true } });
  assert.equal(op.status, 201, op.text);
  assert.equal(op.body.allow_private, true);
  const moved = await k.call("PATCH", `/v1/lifecycle/webhooks/${op.body.id}`, { key: otherKey, body: { url: "http://10.0.0.1/elsewhere" } });
  assert.equal(moved.status, 403, moved.text);
  const off = await k.call("PATCH", `/v1/lifecycle/webhooks/${op.body.id}`, { key: otherKey, body: { allow_private: false } });
  assert.equal(off.status, 400, "its loopback url would be refused without it");
  const offAndAway = await k.call("PATCH", `/v1/lifecycle/webhooks/${op.body.id}`, { key: otherKey, body: { allow_private: false, url: "https://example.com/hook" } });
  assert.equal(offAndAway.status, 200, offAndAway.text);
  assert.equal(offAndAway.body.allow_private, false);
  // Link-local stays refused for everyone.
  const meta = await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: "http://169.254.169.254/latest", operations: ["update"], allow_private: true } });
  assert.equal(meta.status, 400, meta.text);
  await k.call("DELETE", `/v1/lifecycle/webhooks/${op.body.id}`);
});
