// Pure parts of the edge: token signing and checking, the edge secret file, and which headers cross the proxy.

import { test } from "node:test";
import assert from "node:assert/strict";
import { mkdtemp, readFile, rm, stat } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { loadEdgeSecret, signEdgeToken, verifyEdgeToken } from "../../src/deployments/edge-tokens.ts";
import { forwardedHeaders, returnedHeaders } from "../../src/deployments/proxy.ts";
import { scrubUrl } from "../../src/log.ts";
import { edgeTarget } from "../../src/api/routes/edge.ts";

test("the edge secret is made once, mode 0600, and the same secret is read back", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-edge-"));
  try {
    const a = await loadEdgeSecret(dir);
    const file = join(dir, "edge-secret");
    assert.equal((await stat(file)).mode & 0o777, 0o600);
    const before = await readFile(file, "utf8");
    const b = await loadEdgeSecret(dir);
    assert.equal(await readFile(file, "utf8"), before);
    const t = signEdgeToken(a, "svc_1", Date.now() + 60_000);
    assert.ok(verifyEdgeToken(b, "svc_1", t).ok, "a token signed before a restart still verifies");
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test("an edge token verifies only for its service, until it expires, and not when altered", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-edge-"));
  try {
    const secret = await loadEdgeSecret(dir);
    const other = await loadEdgeSecret(join(dir, "other"));
    const now = Date.now();
    const t = signEdgeToken(secret, "svc_a", now + 60_000);
    assert.match(t, /^[0-9a-z]+\.[A-Za-z0-9_-]{43}$/, "URL-safe");
    assert.deepEqual(verifyEdgeToken(secret, "svc_a", t, now), { ok: true, expiresAtMs: Math.floor((now + 60_000) / 1000) * 1000 });
    assert.deepEqual(verifyEdgeToken(secret, "svc_b", t, now), { ok: false, reason: "bad_signature" });
    assert.deepEqual(verifyEdgeToken(other, "svc_a", t, now), { ok: false, reason: "bad_signature" });
    assert.deepEqual(verifyEdgeToken(secret, "svc_a", t, now + 61_000), { ok: false, reason: "expired" });
    const [exp, sig] = t.split(".");
    assert.deepEqual(verifyEdgeToken(secret, "svc_a", `${(parseInt(exp, 36) + 3600).toString(36)}.${sig}`, now), { ok: false, reason: "bad_signature" }, "a pushed-out expiry breaks the signature");
    for (const bad of ["", "x", `${exp}.`, `${exp}.${sig}x`, `${exp}.${sig.slice(1)}`, `-1.${sig}`]) assert.equal(verifyEdgeToken(secret, "svc_a", bad, now).ok, false, bad);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test("edge URLs are scrubbed from log lines", () => {
  assert.equal(scrubUrl("/edge/svc_1/a?x=1&edge_token=abc.def&y=2"), "/edge/svc_1/a?x=1&edge_token=[Redacted]&y=2");
  assert.equal(scrubUrl("/edge/svc_1/?edge_token=abc.def"), "/edge/svc_1/?edge_token=[Redacted]");
});

test("hop-by-hop headers and Kiln's edge cookie never reach the service; forwarding headers are added", () => {
  const out = forwardedHeaders(
    { host: "kiln.example", connection: "keep-alive, x-private", "x-private": "1", "keep-alive": "timeout=5", "transfer-encoding": "chunked", cookie: "a=1; kiln_edge=tok; b=2", "x-forwarded-for": "10.0.0.1", accept: "*/*" },
    { stripCookie: "kiln_edge", clientIp: "127.0.0.1", proto: "https", keepUpgrade: false },
  );
  assert.deepEqual(out, { host: "kiln.example", cookie: "a=1; b=2", "x-forwarded-for": "10.0.0.1, 127.0.0.1", "x-forwarded-proto": "https", "x-forwarded-host": "kiln.example", accept: "*/*" });
  const only = forwardedHeaders({ cookie: "kiln_edge=tok" }, { stripCookie: "kiln_edge", proto: "http", keepUpgrade: false });
  assert.equal(only.cookie, undefined);
  const ws = forwardedHeaders({ connection: "Upgrade", upgrade: "websocket", "sec-websocket-key": "k" }, { stripCookie: "kiln_edge", proto: "http", keepUpgrade: true });
  assert.equal(ws.connection, "Upgrade");
  assert.equal(ws.upgrade, "websocket");
  assert.deepEqual(returnedHeaders({ "content-type": "text/plain", connection: "close", "transfer-encoding": "chunked", "set-cookie": ["a=1"] }), { "content-type": "text/plain", "set-cookie": ["a=1"] });
});

test("an /edge target splits into the service, the target as the service sees it, and the token", () => {
  assert.deepEqual(edgeTarget("/edge/svc_1/a/../b%20c?q=a+b&edge_token=t.k&z"), { serviceId: "svc_1", path: "/a/../b%20c?q=a+b&z", queryToken: "t.k" });
  assert.deepEqual(edgeTarget("/edge/svc_1/"), { serviceId: "svc_1", path: "/", queryToken: undefined });
  assert.deepEqual(edgeTarget("/edge/svc_1/?edge_token=t"), { serviceId: "svc_1", path: "/", queryToken: "t" });
  assert.deepEqual(edgeTarget("/edge/svc_1?edge_token=t"), { redirect: "/edge/svc_1/?edge_token=t" });
  assert.deepEqual(edgeTarget("/edge/svc_1"), { redirect: "/edge/svc_1/" });
  for (const notEdge of ["/v1/machines", "/edge", "/edge/", "/edge//x", "/edge/svc%2F1/x", "/edgey/svc_1/", `/edge/${"a".repeat(65)}/`]) assert.equal(edgeTarget(notEdge), undefined, notEdge);
});
