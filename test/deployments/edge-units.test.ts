// Pure parts of the edge: token signing and checking, the edge secret file, and which headers cross the proxy.

import { test } from "node:test";
import assert from "node:assert/strict";
import { mkdtemp, readFile, rm, stat } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { loadEdgeSecret, signEdgeToken, verifyEdgeToken } from "../../src/deployments/edge-tokens.ts";
import { forwardedHeaders, returnedHeaders } from "../../src/deployments/proxy.ts";
import { scrubUrl } from "../../src/log.ts";
import { edgeTarget, hostTarget } from "../../src/api/routes/edge.ts";
import { confinePathCookies, edgeLabel, edgeOriginOf, hostOnlyCookies, idOfEdgeHost, parseEdgeDomain } from "../../src/deployments/edge-origin.ts";

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
  assert.deepEqual(edgeTarget("/edge/svc_1/a/../b%20c?q=a+b&edge_token=t.k&z"), { serviceId: "svc_1", path: "/a/../b%20c?q=a+b&z", queryToken: "t.k", form: "path" });
  assert.deepEqual(edgeTarget("/edge/svc_1/"), { serviceId: "svc_1", path: "/", queryToken: undefined, form: "path" });
  assert.deepEqual(edgeTarget("/edge/svc_1/?edge_token=t"), { serviceId: "svc_1", path: "/", queryToken: "t", form: "path" });
  assert.deepEqual(edgeTarget("/edge/svc_1?edge_token=t"), { redirect: "/edge/svc_1/?edge_token=t" });
  assert.deepEqual(edgeTarget("/edge/svc_1"), { redirect: "/edge/svc_1/" });
  for (const notEdge of ["/v1/machines", "/edge", "/edge/", "/edge//x", "/edge/svc%2F1/x", "/edgey/svc_1/", `/edge/${"a".repeat(65)}/`]) assert.equal(edgeTarget(notEdge), undefined, notEdge);
});

test("KILN_EDGE_DOMAIN is a host name with an optional port, and names each deployment's origin by a DNS label of its id", () => {
  assert.deepEqual(parseEdgeDomain("Edge.Example.com"), { host: "edge.example.com", port: undefined });
  assert.deepEqual(parseEdgeDomain("localhost:8080"), { host: "localhost", port: "8080" });
  for (const bad of ["https://edge.example.com", "edge.example.com/x", "127.0.0.1", "*.edge.example.com", "edge..com", "edge.example.com:0", "edge.example.com:70000", ""]) assert.equal(parseEdgeDomain(bad), undefined, bad);
  const id = "dep_01m86d0qpq1jpxamy4a0axqys0";
  assert.equal(edgeLabel(id), "dep01m86d0qpq1jpxamy4a0axqys0");
  const domain = parseEdgeDomain("edge.example.com")!;
  assert.equal(edgeOriginOf(id, domain, "https://kiln.example.com"), "https://dep01m86d0qpq1jpxamy4a0axqys0.edge.example.com");
  assert.equal(edgeOriginOf(id, parseEdgeDomain("localhost")!, "http://127.0.0.1:4321"), "http://dep01m86d0qpq1jpxamy4a0axqys0.localhost:4321", "no port of its own: the public URL's");
  assert.equal(edgeOriginOf(id, parseEdgeDomain("localhost:99")!, "http://127.0.0.1:4321"), "http://dep01m86d0qpq1jpxamy4a0axqys0.localhost:99");
  assert.equal(idOfEdgeHost("DEP01M86D0QPQ1JPXAMY4A0AXQYS0.Edge.Example.com:443", domain), id);
  assert.equal(idOfEdgeHost("svc01m86d0qpq1jpxamy4a0axqys0.edge.example.com", domain), "svc_01m86d0qpq1jpxamy4a0axqys0");
  for (const not of [undefined, "edge.example.com", "dep01m86d0qpq1jpxamy4a0axqys0.example.com", "x.dep01m86d0qpq1jpxamy4a0axqys0.edge.example.com", "mch01m86d0qpq1jpxamy4a0axqys0.edge.example.com", "dep01m86d0qpq1jpxamy4a0axqys.edge.example.com", "dep01m86d0qpq1jpxamy4a0axqysu.edge.example.com", "dep01m86d0qpq1jpxamy4a0axqys0.edge.example.com.evil.com"]) assert.equal(idOfEdgeHost(not, domain), undefined, String(not));
  assert.equal(idOfEdgeHost("dep01m86d0qpq1jpxamy4a0axqys0.localhost:98", parseEdgeDomain("localhost:99")!), undefined, "another port is not the edge");
  assert.deepEqual(hostTarget("/a/b?x=1&edge_token=kse_t", "dep01m86d0qpq1jpxamy4a0axqys0.edge.example.com", domain), { serviceId: id, path: "/a/b?x=1", queryToken: "kse_t", form: "host" });
  assert.equal(hostTarget("/", "kiln.example.com", domain), undefined);
  assert.equal(hostTarget("/", "dep01m86d0qpq1jpxamy4a0axqys0.edge.example.com", undefined), undefined, "no edge domain: no edge hosts");
});

test("a service's cookies stay on its own path (path form) or its own host (host form), and never take the edge's name", () => {
  assert.deepEqual(confinePathCookies(["a=1; Path=/", "b=2", "c=3; path=/x; HttpOnly", "d=4; Domain=example.com; Path=/", "kiln_edge=decoy; Path=/"], "dep_1", "kiln_edge"), ["a=1; Path=/edge/dep_1/", "b=2", "c=3; Path=/edge/dep_1/x; HttpOnly"]);
  assert.equal(confinePathCookies("kiln_edge=x", "dep_1", "kiln_edge"), undefined);
  assert.equal(confinePathCookies(undefined, "dep_1", "kiln_edge"), undefined);
  assert.deepEqual(hostOnlyCookies(["a=1; Domain=.example.com; Path=/", "b=2; Secure", " kiln_edge=x"], "kiln_edge"), ["a=1; Path=/", "b=2; Secure"]);
  assert.equal(hostOnlyCookies("kiln_edge=x", "kiln_edge"), undefined);
});
