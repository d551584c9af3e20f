// The foundation as a client sees it: health, bearer auth, the error envelope on every failure, x-request-id,
// OpenAPI, and the first-start key file.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { stat, readFile, mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_BODY_LIMIT_BYTES: "65536" } });
});
after(async () => k?.close());

function assertEnvelope(body: any, code: string) {
  assert.equal(body.code, code);
  assert.equal(typeof body.error, "string");
  assert.ok(body.error.length > 0);
  assert.match(body.request_id, /^req_[0-9a-z]{26}$/);
}

test("GET /health is public and answers {status: ok}", async () => {
  const res = await k.call("GET", "/health", { key: null });
  assert.equal(res.status, 200);
  assert.deepEqual(res.body, { status: "ok" });
  assert.match(String(res.headers["x-request-id"]), /^req_/);
});

test("a /v1 route without a key answers 401 unauthorized with the envelope", async () => {
  const res = await k.call("GET", "/v1/machines", { key: null });
  assert.equal(res.status, 401);
  assertEnvelope(res.body, "unauthorized");
  assert.equal(res.headers["x-request-id"], res.body.request_id);
});

test("a wrong key and a malformed Authorization header answer 401", async () => {
  for (const headers of [{ authorization: "Bearer kiln_not_a_real_key_000000000000000" }, { authorization: "Basic abc" }, { authorization: "Bearer" }]) {
    const res = await k.call("GET", "/v1/ready", { key: null, headers });
    assert.equal(res.status, 401, JSON.stringify(headers));
    assertEnvelope(res.body, "unauthorized");
  }
});

test("an unknown /v1 route answers the 404 envelope", async () => {
  const res = await k.call("GET", "/v1/no-such-thing");
  assert.equal(res.status, 404);
  assertEnvelope(res.body, "not_found");
});

test("a known route with the wrong method answers 405 with Allow", async () => {
  const res = await k.call("PUT", "/v1/machines");
  assert.equal(res.status, 405);
  assertEnvelope(res.body, "method_not_allowed");
  assert.match(String(res.headers.allow), /GET/);
});

test("malformed JSON answers 400 invalid_request", async () => {
  const res = await k.call("POST", "/v1/machines", { raw: "{not json", headers: { "content-type": "application/json" } });
  assert.equal(res.status, 400);
  assertEnvelope(res.body, "invalid_request");
});

test("unknown request fields are rejected, not ignored", async () => {
  const res = await k.call("POST", "/v1/machines", { body: { template: "local/base", colour: "blue" } });
  assert.equal(res.status, 400);
  assertEnvelope(res.body, "invalid_request");
  const list = await k.call("GET", "/v1/machines");
  assert.equal(list.body.machines.length, 0, "a refused create makes no machine");
});

test("a schema failure names the field", async () => {
  const res = await k.call("POST", "/v1/machines", { body: { timeout_s: "soon" } });
  assert.equal(res.status, 400);
  assertEnvelope(res.body, "invalid_request");
  assert.match(res.body.error, /timeout_s/);
});

test("a body over the limit answers 413 payload_too_large", async () => {
  const res = await k.call("POST", "/v1/machines", { raw: JSON.stringify({ name: "x".repeat(70_000) }), headers: { "content-type": "application/json" } });
  assert.equal(res.status, 413);
  assertEnvelope(res.body, "payload_too_large");
});

test("a content type the route does not take answers 415", async () => {
  const res = await k.call("POST", "/v1/machines", { raw: "template=base", headers: { "content-type": "application/x-www-form-urlencoded" } });
  assert.equal(res.status, 415);
  assertEnvelope(res.body, "unsupported_media_type");
});

test("GET /v1/ready reports the store and the driver", async () => {
  const res = await k.call("GET", "/v1/ready");
  assert.equal(res.status, 200, res.text);
  assert.equal(res.body.status, "ready");
  assert.equal(res.body.store.ok, true);
  assert.equal(res.body.store.dialect, "sqlite");
  assert.ok(Array.isArray(res.body.driver.cgroup.enforced));
  // The pools: the base template's warm pool as configured, and no hot template's before any template is created.
  const warm = k.kiln.services.pool.stats();
  assert.equal(res.body.pools.warm.size, warm.size);
  assert.ok(res.body.pools.warm.ready + res.body.pools.warm.booting <= warm.size);
  assert.deepEqual(res.body.pools.hot, []);
});

test("GET /v1/openapi.json documents the routes with their schemas", async () => {
  const res = await k.call("GET", "/v1/openapi.json");
  assert.equal(res.status, 200);
  assert.equal(res.body.info.version, "0.1.0");
  for (const path of ["/v1/machines", "/v1/machines/{id}", "/v1/machines/{id}/exec", "/v1/machines/{id}/files/info", "/health", "/v1/ready"]) {
    assert.ok(res.body.paths[path], `${path} is documented`);
  }
  assert.ok(res.body.paths["/v1/machines/{id}/files/info"].post.requestBody, "files/info documents its body");
});

test("API keys: create shows the key once, it works, revoke stops it", async () => {
  const made = await k.call("POST", "/v1/keys", { body: { name: "second" } });
  assert.equal(made.status, 201);
  assert.match(made.body.key, /^kiln_[A-Za-z0-9]{32,}$/);
  assert.equal((await k.call("GET", "/v1/ready", { key: made.body.key })).status, 200);
  const listed = await k.call("GET", "/v1/keys");
  assert.ok(listed.body.keys.every((row: any) => row.key === undefined && row.hash === undefined), "keys are listed without secrets");
  assert.equal((await k.call("DELETE", `/v1/keys/${made.body.id}`)).status, 200);
  const refused = await k.call("GET", "/v1/ready", { key: made.body.key });
  assert.equal(refused.status, 401);
});

test("the key never reaches the log", async () => {
  await k.call("GET", "/v1/ready");
  assert.ok(k.logs.length > 0);
  assert.ok(!k.logs.join("").includes(TEST_KEY));
});

test("first start with no key writes one to $KILN_DATA_DIR/api-key (0600) and logs only the path", async () => {
  const dataDir = await mkdtemp(join(tmpdir(), "kiln-firststart-"));
  const fresh = await startTestKiln({ dataDir, env: { KILN_API_KEY: "" }, waitForBase: false });
  try {
    const file = join(dataDir, "api-key");
    const key = (await readFile(file, "utf8")).trim();
    assert.match(key, /^kiln_[A-Za-z0-9]{32,}$/);
    assert.equal((await stat(file)).mode & 0o777, 0o600);
    const logged = fresh.logs.join("");
    assert.ok(logged.includes(file), "the log names the file");
    assert.ok(!logged.includes(key), "the log never holds the key");
    const res = await request(fresh.url + "/v1/ready", { headers: { authorization: `Bearer ${key}` } });
    assert.equal(res.statusCode, 200);
    await res.body.dump();
  } finally {
    await fresh.close();
    await rm(dataDir, { recursive: true, force: true });
  }
});
