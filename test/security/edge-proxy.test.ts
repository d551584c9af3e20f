// The public edge against hostile service clients, with real services in real machines: Kiln's own credentials never
// reach a service; a service whose requests hang stalls neither itself past the bounds nor another service; only a
// WebSocket handshake the service answered with 101 ever becomes a pipe, and that pipe ends with its token.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { WebSocket } from "ws";
import { DatabaseSync } from "node:sqlite";
import { join } from "node:path";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { createDeployment, services, waitService } from "../deployments/support.ts";
import { loadEdgeSecret, signEdgeToken } from "../../src/deployments/edge-tokens.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { probeCommand, rawConnection } from "./edge-support.ts";

// Long enough that the 64 hanging requests are all still held while the test fills the queue behind them (gVisor is slower).
const HEADERS_TIMEOUT_S = 10;
const IDLE_TIMEOUT_S = 3;
const QUEUE = 8;
const CONNECTIONS = 64;

let k: TestKiln;
before(async () => {
  k = await startTestKiln({
    env: { KILN_EDGE_MAX_CONNECTIONS: String(CONNECTIONS), KILN_EDGE_QUEUE: String(QUEUE), KILN_EDGE_HEADERS_TIMEOUT_S: String(HEADERS_TIMEOUT_S), KILN_EDGE_IDLE_TIMEOUT_S: String(IDLE_TIMEOUT_S), KILN_WARM_POOL: "0" },
  });
});
after(async () => {
  if (!k) return;
  const res = await k.call("GET", "/v1/agent-deployments");
  for (const d of res.body?.deployments ?? []) await k.call("DELETE", `/v1/agent-deployments/${d.id}`);
  await k.close();
});

const fast = { interval_s: 0.2, timeout_s: 1 };
const probes = new Map<string, { svc: any; base: string; token: string; machine: string }>();

/** A ready deployment of the probe service; `name` keeps one per test role (`access` as the deployment's, token by default). */
async function probe(name: string, access?: "signed") {
  const known = probes.get(name);
  if (known) return known;
  const dep = await createDeployment(k, { name, command: probeCommand(8080), port: 8080, readiness: { ...fast, path: "/" }, ...(access ? { access } : {}) });
  const [first] = await services(k, dep.id);
  const svc = await waitService(k, dep.id, first.id, (s) => s.status === "ready");
  const url = new URL(svc.public_url);
  const p = { svc, base: `${url.origin}/edge/${svc.id}`, token: url.searchParams.get("edge_token")!, machine: svc.machine_id };
  probes.set(name, p);
  return p;
}

async function sh(machine: string, cmd: string) {
  const res = await k.call("POST", `/v1/machines/${machine}/exec`, { body: { cmd, user: "root" } });
  assert.equal(res.status, 200, res.text);
  return res.body.stdout as string;
}

test("a Kiln key, E2B credentials and Kiln's edge token and cookie sent with an edge request never reach the service; the service's own credentials do", async () => {
  const p = await probe("creds");
  const e2bKey = (await k.kiln.services.keys.create("sec-e2b", generateKeyIn("e2b"))).key;
  const revoked = await k.kiln.services.keys.create("sec-revoked");
  await k.kiln.services.keys.revoke(revoked.id);
  const seen = async (headers: Record<string, string>) => {
    const res = await request(`${p.base}/headers?edge_token=${p.token}&x=1`, { headers });
    assert.equal(res.statusCode, 200);
    return res.body.text();
  };
  const kilnSecrets = [TEST_KEY, e2bKey, revoked.key, p.token];
  const cases: Record<string, string>[] = [
    { authorization: `Bearer ${TEST_KEY}` }, // the operator's KILN_API_KEY: not in an issued format, found by its hash
    { authorization: `bearer ${e2bKey}` },
    { authorization: `Bearer ${revoked.key}` }, // revoked keys are still Kiln's secrets
    { authorization: `Basic ${Buffer.from(`user:${TEST_KEY}`).toString("base64")}` },
    { authorization: `Token ${e2bKey}` },
    { "x-api-key": e2bKey },
    { "x-api-key": TEST_KEY },
    { "x-access-token": "an-envd-token", "e2b-traffic-access-token": "a-traffic-token" },
    { cookie: `kiln_edge=${p.token}; theirs=1` },
  ];
  for (const headers of cases) {
    const got = await seen(headers);
    for (const secret of [...kilnSecrets, "an-envd-token", "a-traffic-token"]) assert.ok(!got.includes(secret), `${JSON.stringify(Object.keys(headers))}: the service saw a Kiln credential:\n${got}`);
    assert.doesNotMatch(got, /^(authorization|x-api-key|x-access-token|e2b-traffic-access-token):/m, JSON.stringify(headers));
    assert.doesNotMatch(got, /edge_token|kiln_edge/);
  }
  assert.match(await seen({ cookie: `kiln_edge=${p.token}; theirs=1` }), /^cookie: theirs=1$/m, "the service's own cookie passes");
  // A service's own credentials pass as they were sent.
  assert.match(await seen({ authorization: "Bearer the-service's-own-token" }), /^authorization: Bearer the-service's-own-token$/m);
  assert.match(await seen({ authorization: `Basic ${Buffer.from("alice:wonderland").toString("base64")}` }), /^authorization: Basic YWxpY2U6d29uZGVybGFuZA==$/m);
  assert.match(await seen({ "x-api-key": "service-key-123" }), /^x-api-key: service-key-123$/m);
  // A key a browser offers as a WebSocket subprotocol (the console's kiln.bearer.<base64url>) is dropped; the
  // service's own subprotocols pass.
  const bearer = `kiln.bearer.${Buffer.from(TEST_KEY).toString("base64url")}`;
  const protocols = await seen({ "sec-websocket-protocol": `chat, ${bearer}` });
  assert.ok(!protocols.includes(bearer), `the service saw a key in a subprotocol:\n${protocols}`);
  assert.match(protocols, /^sec-websocket-protocol: chat$/m);

  // The same over a WebSocket handshake: the probe's first frame is the head it got.
  const ws = new WebSocket(`ws://${new URL(p.base).host}/edge/${p.svc.id}/ws?edge_token=${p.token}`, { headers: { authorization: `Bearer ${TEST_KEY}`, "x-api-key": e2bKey, cookie: `kiln_edge=${p.token}` } });
  const head = await new Promise<string>((resolve, reject) => {
    ws.once("message", (d) => resolve(String(d)));
    ws.once("error", reject);
  });
  ws.close();
  assert.match(head, /^upgrade: websocket$/m);
  for (const secret of kilnSecrets) assert.ok(!head.includes(secret), `the WebSocket handshake carried a Kiln credential:\n${head}`);
});

test(`${CONNECTIONS} hanging requests don't hold a normal request past the bound; past the queue the service answers 503 at once; another service is untouched`, async () => {
  const p = await probe("hang");
  const other = await probe("other");
  const cookie = { cookie: `kiln_edge=${p.token}` };
  const timed = (path: string) => {
    const started = Date.now();
    return request(`${p.base}${path}`, { headers: cookie, headersTimeout: 120_000, bodyTimeout: 120_000 }).then(
      async (res) => ({ status: res.statusCode, body: await res.body.text(), ms: Date.now() - started }),
      (err: Error) => ({ status: 0, body: String(err), ms: Date.now() - started }),
    );
  };
  const hanging = Array.from({ length: CONNECTIONS }, () => timed("/hang"));
  // Every one of them reached the service (it counts them) before the rest is sent.
  for (let i = 0; i < 600 && Number((await sh(p.machine, "cat /tmp/hangs 2>/dev/null | wc -l")).trim()) < CONNECTIONS; i++) await new Promise((r) => setTimeout(r, 50));
  assert.equal(Number((await sh(p.machine, "wc -l < /tmp/hangs")).trim()), CONNECTIONS);
  const normal = timed("/hello");
  const queued = Array.from({ length: QUEUE - 1 }, () => timed("/hang"));
  // The queue is full now: more requests are refused at once, retryable.
  for (let i = 0; i < 3; i++) {
    const started = Date.now();
    const full = await request(`${p.base}/hello`, { headers: cookie });
    const body = (await full.body.json()) as any;
    assert.equal(full.statusCode, 503, JSON.stringify(body));
    assert.equal(body.code, "unavailable");
    assert.equal(body.error_detail?.retryable, true);
    assert.ok(Date.now() - started < 1500, `a full queue answers at once (${Date.now() - started} ms)`);
  }
  // Another service answers meanwhile.
  const beside = await request(`${other.base}/hello?edge_token=${other.token}`);
  assert.equal(beside.statusCode, 200);
  assert.equal(await beside.body.text(), "hello from /hello");

  const bound = HEADERS_TIMEOUT_S * 1000;
  const slack = 4000;
  const n = await normal;
  assert.ok(n.status === 200 || n.status === 503, `the normal request is answered: ${n.status} ${n.body}`);
  assert.ok(n.ms < 2 * bound + slack, `the normal request waited ${n.ms} ms`);
  for (const h of await Promise.all(hanging)) {
    assert.equal(h.status, 504, h.body);
    assert.equal(JSON.parse(h.body).code, "timeout");
    assert.ok(h.ms < bound + slack, `a hanging request was answered after ${h.ms} ms`);
  }
  for (const q of await Promise.all(queued)) {
    assert.ok(q.status === 504 || q.status === 503, `${q.status} ${q.body}`);
    assert.ok(q.ms < 2 * bound + slack, `a queued hanging request was answered after ${q.ms} ms`);
  }
  // Nothing is left held: the service answers at once again.
  const afterwards = await timed("/hello");
  assert.equal(afterwards.status, 200, afterwards.body);
  assert.ok(afterwards.ms < 2000, `${afterwards.ms} ms`);
});

test("a response body that goes silent is cut at the idle bound instead of holding its connection", async () => {
  const p = await probe("creds");
  const started = Date.now();
  const res = await request(`${p.base}/stall?edge_token=${p.token}`, { bodyTimeout: 60_000 });
  assert.equal(res.statusCode, 200);
  await assert.rejects(res.body.text(), "the stalled body ends in an error, not a hang");
  const ms = Date.now() - started;
  assert.ok(ms >= IDLE_TIMEOUT_S * 1000 - 500 && ms < IDLE_TIMEOUT_S * 1000 + 4000, `cut after ${ms} ms`);
});

test("Connection: Upgrade to anything but WebSocket is served as a plain request: the next request on that socket is checked again", async () => {
  const p = await probe("creds");
  const host = new URL(p.base).host;
  const c = await rawConnection(p.base);
  try {
    c.write(`GET /edge/${p.svc.id}/headers?edge_token=${p.token} HTTP/1.1\r\nHost: ${host}\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n`);
    const first = await c.waitFor(/\r\n\r\n[\s\S]*host: /);
    assert.match(first, /^HTTP\/1\.1 200 /);
    assert.doesNotMatch(first, /^upgrade:|^http2-settings:/im, "the service never sees the upgrade offer");
    const mark = c.received().length;
    // No token, no cookie: a pipe would hand this to the service; the edge refuses it.
    c.write(`GET /edge/${p.svc.id}/headers HTTP/1.1\r\nHost: ${host}\r\n\r\n`);
    const second = (await c.waitFor(/HTTP\/1\.1 \d{3}[\s\S]*\r\n\r\n[\s\S]*"code":"unauthorized"/, 10_000)).slice(mark);
    assert.match(second, /^HTTP\/1\.1 401 /, second);
    assert.match(second, /"code":"unauthorized"/);
  } finally {
    c.close();
  }
});

test("a WebSocket handshake the service answers without 101 is relayed and the connection closed: it never becomes a pipe", async () => {
  const p = await probe("creds");
  const host = new URL(p.base).host;
  const c = await rawConnection(p.base);
  try {
    c.write(
      `GET /edge/${p.svc.id}/hello?edge_token=${p.token} HTTP/1.1\r\nHost: ${host}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n`,
    );
    const answer = await c.waitFor(/hello from \/hello/);
    assert.match(answer, /^HTTP\/1\.1 200 /);
    assert.match(answer, /^connection: close$/im);
    // A request written now must reach nobody: the connection ends.
    c.write(`GET /edge/${p.svc.id}/headers HTTP/1.1\r\nHost: ${host}\r\n\r\n`);
    assert.equal(await c.ended(5000), true, "the connection was closed after the non-101 answer");
    assert.doesNotMatch(c.received(), /host: /, "the second request never reached the service");
  } finally {
    c.close();
  }
});

test("a WebSocket through the edge closes when the edge token that opened it expires", async () => {
  const p = await probe("expiring", "signed");
  const secret = await loadEdgeSecret(k.dataDir);
  // Tokens carry whole seconds: this one expires 2–3 s from now.
  const expiresAt = (Math.floor(Date.now() / 1000) + 3) * 1000;
  // Signed tokens cover the deployment's salt (a rotation stops them): read it from the store, as the server does.
  const store = new DatabaseSync(join(k.dataDir, "kiln.db"), { readOnly: true });
  const { edge_salt: salt } = store.prepare("select edge_salt from deployments where id = ?").get(p.svc.deployment_id) as { edge_salt: string };
  store.close();
  const token = signEdgeToken(secret, p.svc.id, expiresAt, salt);
  const ws = new WebSocket(`ws://${new URL(p.base).host}/edge/${p.svc.id}/ws?edge_token=${token}`);
  const messages: string[] = [];
  ws.on("message", (d) => messages.push(String(d)));
  await new Promise<void>((resolve, reject) => {
    ws.once("open", () => resolve());
    ws.once("error", reject);
  });
  ws.send("still there");
  const closedAt = await new Promise<number>((resolve) => ws.once("close", () => resolve(Date.now())));
  assert.ok(messages.includes("still there"), "the pipe worked while the token was valid");
  assert.ok(closedAt >= expiresAt - 50 && closedAt < expiresAt + 3000, `closed ${closedAt - expiresAt} ms after the token expired`);
  // And a new handshake with the same token is refused.
  const again = new WebSocket(`ws://${new URL(p.base).host}/edge/${p.svc.id}/ws?edge_token=${token}`);
  const status = await new Promise<number>((resolve) => {
    again.once("unexpected-response", (_req, res) => resolve(res.statusCode ?? 0));
    again.once("open", () => resolve(101));
  });
  again.on("error", () => undefined);
  again.terminate();
  assert.equal(status, 401);
});
