// E2B's `sandbox.getHost(port)` through Kiln against hostile clients, driven by the published `e2b` SDK and a real
// server in a real sandbox: the sandbox's access token, E2B's traffic token and Kiln's API keys never reach the
// sandbox's server, and only a WebSocket handshake the server answered with 101 becomes a pipe.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { WebSocket } from "ws";
import { Sandbox } from "e2b";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { PROBE_PY, rawConnection } from "./edge-support.ts";

let k: TestKiln;
let sbx: Sandbox;
let key: string;
let token: string;
let host: string;

before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  key = (await k.kiln.services.keys.create("sec-e2b-ports", generateKeyIn("e2b"))).key;
  sbx = await Sandbox.create("base", { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 30_000 });
  token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
  await sbx.files.write("/tmp/probe.py", PROBE_PY);
  await sbx.commands.run("exec python3 /tmp/probe.py 8000", { background: true });
  host = sbx.getHost(8000);
  for (let i = 0; i < 200; i++) {
    const res = await request(`${k.url}/`, { headers: { host, "e2b-traffic-access-token": token } });
    await res.body.dump();
    if (res.statusCode === 200) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.fail("the probe server in the sandbox never answered");
});
after(async () => {
  await sbx?.kill().catch(() => undefined);
  await k?.close();
});

test("the sandbox's token, E2B's traffic token and Kiln API keys sent to a sandbox port never reach its server; the server's own credentials do", async () => {
  const seen = async (headers: Record<string, string>) => {
    const res = await request(`${k.url}/headers`, { headers: { host, "e2b-traffic-access-token": token, ...headers } });
    assert.equal(res.statusCode, 200);
    return res.body.text();
  };
  const secrets = [token, key, TEST_KEY];
  const cases: Record<string, string>[] = [
    {},
    { "x-access-token": token },
    { "x-api-key": key },
    { authorization: `Bearer ${key}` },
    { authorization: `Bearer ${TEST_KEY}` },
    { authorization: `Bearer ${token}` }, // the sandbox's own access token as a bearer
    { authorization: `Basic ${Buffer.from(`user:${token}`).toString("base64")}` },
  ];
  for (const headers of cases) {
    const got = await seen(headers);
    for (const s of secrets) assert.ok(!got.includes(s), `${JSON.stringify(Object.keys(headers))}: the sandbox's server saw a credential:\n${got}`);
    assert.doesNotMatch(got, /^(authorization|x-api-key|x-access-token|e2b-traffic-access-token):/m);
  }
  assert.match(await seen({ authorization: "Bearer the-server's-own-token" }), /^authorization: Bearer the-server's-own-token$/m);
  assert.match(await seen({ "x-api-key": "server-key-1" }), /^x-api-key: server-key-1$/m);

  // A WebSocket handshake is cleaned the same way (the probe's first frame is the head it got).
  const ws = new WebSocket(`${k.url.replace("http", "ws")}/ws`, { headers: { host, "e2b-traffic-access-token": token, "x-api-key": key, authorization: `Bearer ${token}` } });
  const head = await new Promise<string>((resolve, reject) => {
    ws.once("message", (d) => resolve(String(d)));
    ws.once("error", reject);
  });
  ws.close();
  assert.match(head, /^upgrade: websocket$/m);
  for (const s of secrets) assert.ok(!head.includes(s), `the WebSocket handshake carried a credential:\n${head}`);
});

test("a non-WebSocket Upgrade to a sandbox port is a plain request, and the next request on the socket needs the token again", async () => {
  const c = await rawConnection(k.url);
  try {
    c.write(`GET /headers HTTP/1.1\r\nHost: ${host}\r\ne2b-traffic-access-token: ${token}\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n`);
    const first = await c.waitFor(/\r\n\r\n[\s\S]*host: /);
    assert.match(first, /^HTTP\/1\.1 200 /);
    assert.doesNotMatch(first, /^upgrade:/im, "the server never sees the upgrade offer");
    const mark = c.received().length;
    c.write(`GET /headers HTTP/1.1\r\nHost: ${host}\r\n\r\n`);
    const second = (await c.waitFor(/HTTP\/1\.1 \d{3}[\s\S]*\r\n\r\n[\s\S]*"code":401/, 10_000)).slice(mark);
    assert.match(second, /^HTTP\/1\.1 401 /, second);
  } finally {
    c.close();
  }
});

test("a WebSocket handshake a sandbox's server answers without 101 ends the connection after the answer", async () => {
  const c = await rawConnection(k.url);
  try {
    c.write(`GET /hello HTTP/1.1\r\nHost: ${host}\r\ne2b-traffic-access-token: ${token}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n`);
    const answer = await c.waitFor(/hello from \/hello/);
    assert.match(answer, /^HTTP\/1\.1 200 /);
    c.write(`GET /headers HTTP/1.1\r\nHost: ${host}\r\n\r\n`);
    assert.equal(await c.ended(5000), true, "the connection was closed after the non-101 answer");
    assert.doesNotMatch(c.received(), /host: /, "the second request never reached the server");
  } finally {
    c.close();
  }
});
