// Service clients and ex-key holders against the edge and E2B's sandbox ports, with real services in real machines:
// a slow upload (a body dripped just under the idle bound) is ended at the request's total bound and frees its place
// for the next request; and sockets opened through a sandbox's port with a key's envd token — an upgraded WebSocket
// pipe, a request in flight — close within seconds of that key's revocation.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { WebSocket } from "ws";
import { Sandbox } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { createDeployment, services, waitService } from "../deployments/support.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { PROBE_PY, probeCommand, rawConnection } from "./edge-support.ts";

const IDLE_TIMEOUT_S = 3;
const REQUEST_TIMEOUT_S = 5;

let k: TestKiln;
before(async () => {
  k = await startTestKiln({
    env: {
      // One place per service, so a request that keeps its place shows at once in the next one's wait.
      KILN_EDGE_MAX_CONNECTIONS: "1",
      KILN_EDGE_HEADERS_TIMEOUT_S: "60",
      KILN_EDGE_IDLE_TIMEOUT_S: String(IDLE_TIMEOUT_S),
      KILN_EDGE_REQUEST_TIMEOUT_S: String(REQUEST_TIMEOUT_S),
      KILN_WARM_POOL: "0",
    },
  });
});
after(async () => {
  if (!k) return;
  const res = await k.call("GET", "/v1/agent-deployments");
  for (const d of res.body?.deployments ?? []) await k.call("DELETE", `/v1/agent-deployments/${d.id}`);
  await k.close();
});

test("a request body dripped under the idle bound is ended at the edge's request bound (504), and the service's place goes to the next request", async () => {
  const dep = await createDeployment(k, { name: "slow-upload", command: probeCommand(8080), port: 8080, readiness: { interval_s: 0.2, timeout_s: 1, path: "/" } });
  const [first] = await services(k, dep.id);
  const svc = await waitService(k, dep.id, first.id, (s) => s.status === "ready");
  const url = new URL(svc.public_url);
  const path = `/edge/${svc.id}/upload?edge_token=${url.searchParams.get("edge_token")}`;

  const slow = await rawConnection(k.url);
  const started = Date.now();
  slow.write(`POST ${path} HTTP/1.1\r\nHost: ${url.host}\r\ncontent-type: application/octet-stream\r\ncontent-length: 100000\r\n\r\n`);
  // One byte a second: always under the idle bound, never done.
  const drip = setInterval(() => slow.write("x"), 1000);
  try {
    // The next request waits behind it for the one place.
    await new Promise((r) => setTimeout(r, 500));
    const next = request(`${url.origin}/edge/${svc.id}/after?edge_token=${url.searchParams.get("edge_token")}`);
    const answer = await slow.waitFor(/^HTTP\/1\.1 \d{3} /, (REQUEST_TIMEOUT_S + 20) * 1000);
    const cutAfter = (Date.now() - started) / 1000;
    assert.match(answer, /^HTTP\/1\.1 504 /, `the dripping upload was answered: ${answer.slice(0, 200)}`);
    assert.match(answer, /not received within/);
    assert.ok(cutAfter >= REQUEST_TIMEOUT_S - 0.5, `not before its bound (${cutAfter} s)`);
    const res = await next;
    assert.equal(res.statusCode, 200);
    assert.equal(await res.body.text(), "hello from /after");
  } finally {
    clearInterval(drip);
    slow.close();
  }
  // A whole body sent steadily within the bound still goes through.
  const body = Buffer.alloc(64 * 1024, 1);
  const ok = await request(`${url.origin}${path}`, { method: "POST", body, headers: { "content-type": "application/octet-stream" } });
  assert.equal(ok.statusCode, 200);
  assert.equal(await ok.body.text(), `got ${body.length} bytes`);
});

test("an E2B sandbox port's WebSocket pipe and request in flight close within seconds of the key's revocation; the token is refused after", async () => {
  const created = await k.call("POST", "/v1/keys", { body: { name: "sec-port-revoke", format: "e2b" } });
  assert.equal(created.status, 201, created.text);
  const { id: keyId, key } = created.body;
  const sbx = await Sandbox.create("base", { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 30_000 });
  try {
    const token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
    await sbx.files.write("/tmp/probe.py", PROBE_PY);
    await sbx.commands.run("exec python3 /tmp/probe.py 8000", { background: true });
    const host = sbx.getHost(8000);
    for (let i = 0; ; i++) {
      const res = await request(`${k.url}/`, { headers: { host, "e2b-traffic-access-token": token } });
      await res.body.dump();
      if (res.statusCode === 200) break;
      assert.ok(i < 200, "the probe server in the sandbox never answered");
      await new Promise((r) => setTimeout(r, 100));
    }
    const ws = new WebSocket(`${k.url.replace("http", "ws")}/ws`, { headers: { host, "e2b-traffic-access-token": token } });
    await new Promise<void>((resolve, reject) => {
      ws.once("message", () => resolve());
      ws.once("error", reject);
    });
    const closed = new Promise<void>((resolve) => ws.once("close", () => resolve()));
    const hanging = await rawConnection(k.url);
    hanging.write(`GET /hang HTTP/1.1\r\nHost: ${host}\r\ne2b-traffic-access-token: ${token}\r\n\r\n`);
    await new Promise((r) => setTimeout(r, 300));

    const revoked = await k.call("DELETE", `/v1/keys/${keyId}`);
    assert.ok(revoked.status === 200 || revoked.status === 204, revoked.text);
    const at = Date.now();
    const outcome = await Promise.race([closed.then(() => "closed"), new Promise((r) => setTimeout(() => r("open"), 5000))]);
    assert.equal(outcome, "closed", "the WebSocket pipe opened with the revoked key's token stayed open");
    assert.ok(Date.now() - at < 5000);
    assert.equal(await hanging.ended(5000), true, "the request in flight with the revoked key's token was not cut");

    const after = await request(`${k.url}/hello`, { headers: { host, "e2b-traffic-access-token": token } });
    await after.body.dump();
    assert.equal(after.statusCode, 401, "the revoked key's token opens nothing more");
  } finally {
    await k.kiln.services.machines.destroy(`mch_${sbx.sandboxId}`).catch(() => undefined);
  }
});
