// Authentication decided by the matched route, never the raw URL: a matrix generated from the server's own route
// table (every route × every credential a stranger or an ex-key-holder has × every spelling of its path that the
// router folds back onto it), sent as raw bytes over HTTP and as WebSocket upgrades. Plus the fail-closed start.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import Fastify from "fastify";
import websocket from "@fastify/websocket";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { rawRequest, inParallel, UPGRADE_HEADERS } from "./raw-http.ts";
import type { RouteAuth } from "../../src/api/auth.ts";
import { createAuth } from "../../src/api/auth.ts";
import { openStore } from "../../src/store/db.ts";
import { createKeyService } from "../../src/keys/service.ts";
import { createTokens, loadTokenSecret } from "../../src/compat/e2b/token.ts";
import type { App } from "../../src/api/app-type.ts";

let k: TestKiln;
let port: number;
let revokedKey: string;
let revokedKeyId: string;
let table: RouteAuth[];
const WRONG_KEY = "kiln_wrong00000000000000000000000000000000";
const SANDBOX = "mch_00000000000000000000000000";

before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" }, waitForBase: false });
  port = Number(new URL(k.url).port);
  const made = await k.call("POST", "/v1/keys", { body: { name: "to-revoke" } });
  revokedKey = made.body.key;
  revokedKeyId = made.body.id;
  assert.equal((await k.call("GET", "/v1/keys", { key: revokedKey })).status, 200, "the key works before it is revoked");
  assert.equal((await k.call("DELETE", `/v1/keys/${revokedKeyId}`)).status, 200);
  table = k.kiln.app.routeTable();
});
after(async () => k?.close());

/** A path the route matches: params filled, wildcards given a tail. */
function concrete(url: string): string {
  return url.replace(/:[A-Za-z_]+/g, "p1x").replace(/\*$/, "x/y");
}

const pct = (c: string) => "%" + c.charCodeAt(0).toString(16).toUpperCase().padStart(2, "0");
const firstSegment = (path: string) => /^\/[^/]*/.exec(path)![0];

/** Every spelling of `path` a router, a proxy or a client library might fold back onto it. */
function spellings(path: string): { name: string; target: string }[] {
  const out = [{ name: "as registered", target: path }];
  for (let i = 0; i < path.length; i++) {
    if (path[i] !== "/") out.push({ name: `${path[i]} at ${i} percent-encoded`, target: path.slice(0, i) + pct(path[i]) + path.slice(i + 1) });
  }
  out.push({ name: "every character percent-encoded", target: path.replace(/[^/]/g, pct) });
  out.push({ name: "lower-case hex escapes", target: path.replace(/[^/]/g, (c) => pct(c).toLowerCase()) });
  out.push({ name: "absolute-form", target: `http://kiln.test${path}` });
  out.push({ name: "absolute-form with port and https", target: `https://evil.example:443${path}` });
  out.push({ name: "absolute-form, encoded", target: `http://x${path.replace(/[^/]/, pct)}` });
  out.push({ name: "leading //", target: "/" + path });
  out.push({ name: "inner //", target: path.replace(/^(\/[^/]*)\//, "$1//") });
  out.push({ name: "leading /./", target: "/." + path });
  out.push({ name: "inner /./", target: path.replace(/^(\/[^/]*)\//, "$1/./") });
  out.push({ name: "/x/../", target: "/x/.." + path });
  out.push({ name: "/v1/../", target: "/v1/.." + path });
  out.push({ name: "encoded /%2e%2e/", target: "/v1/%2e%2e" + path });
  out.push({ name: "upper case", target: path.toUpperCase() });
  out.push({ name: "upper-case first segment", target: path.replace(firstSegment(path), firstSegment(path).toUpperCase()) });
  out.push({ name: "; params at the end", target: path + ";x=1" });
  out.push({ name: "; params in the first segment", target: path.replace(firstSegment(path), firstSegment(path) + ";x") });
  out.push({ name: "trailing /", target: path + "/" });
  out.push({ name: "query", target: path + "?a=1" });
  if (path.lastIndexOf("/") > 0) out.push({ name: "encoded last /", target: path.replace(/\/(?=[^/]*$)/, "%2F") });
  return out;
}

/** The refusal every credential-less spelling of a non-public route must get: 401, in Kiln's or E2B's envelope. */
function assertRefused(res: { status: number; head: string; body: string }, what: string, method = "GET") {
  assert.equal(res.status, 401, `${what} → ${res.head.split("\r\n")[0]} ${res.body.slice(0, 200)}`);
  if (method === "HEAD") return;
  const body = JSON.parse(res.body);
  // Kiln's envelope, E2B's {code: 401} or, on envd's Connect RPCs, Connect's "unauthenticated".
  assert.ok(["unauthorized", 401, "unauthenticated"].includes(body.code), `${what}: the refusal is an envelope: ${res.body.slice(0, 200)}`);
}

function routesOf(auth: RouteAuth["auth"][]) {
  return table.filter((r) => auth.includes(r.auth));
}

test("the route table is the server's own: every route declares its auth, and there are routes of every kind in use", () => {
  assert.ok(table.length > 100, `${table.length} routes`);
  for (const kind of ["key", "none", "envd-token", "e2b-volume-token", "e2b-upload", "edge-token"] as const) assert.ok(table.some((r) => r.auth === kind), `a route with auth ${kind}`);
  // Public: liveness, the API's description, the web console's page and assets (which hold no data).
  assert.deepEqual(
    routesOf(["none"]).map((r) => `${r.method} ${r.url}`).sort(),
    ["GET /console", "GET /console/assets/*", "GET /health", "GET /v1/openapi.json", "HEAD /console", "HEAD /console/assets/*", "HEAD /health", "HEAD /v1/openapi.json"].sort(),
  );
  // E2B's volume content API takes its volume's token, nothing else.
  assert.deepEqual([...new Set(table.filter((r) => r.url.startsWith("/volumecontent/")).map((r) => r.auth))], ["e2b-volume-token"]);
  // E2B template file uploads take their signed link, nothing else.
  assert.deepEqual(table.filter((r) => r.auth === "e2b-upload").map((r) => `${r.method} ${r.url}`), ["PUT /e2b-template-files/:id/:hash"]);
  // Host-to-host: a peer's layer fetch, answered on a cluster signature only (docs/hosts.md), never on a key.
  // And the port tunnel a peer's edge or E2B port proxy opens to a machine of this host (an upgrade, kiln-tunnel),
  // replicas a peer places here, and a volume's image a peer moves here.
  assert.deepEqual(routesOf(["cluster"]).map((r) => `${r.method} ${r.url}`).sort(), [
    "GET /v1/cluster/layers/:digest",
    "GET /v1/cluster/machines/:id/ports/:port/tunnel",
    "HEAD /v1/cluster/layers/:digest",
    "HEAD /v1/cluster/machines/:id/ports/:port/tunnel",
    "POST /v1/cluster/deployments/:deployment_id/replicas",
    "POST /v1/cluster/services/:service_id/stop",
    "PUT /v1/cluster/volumes/:id/image",
  ].sort());
  for (const r of table) if (r.url.startsWith("/v1/")) assert.ok(r.auth === "key" || r.url === "/v1/openapi.json" || (r.auth === "cluster" && r.url.startsWith("/v1/cluster/")), `${r.method} ${r.url} is key-authenticated`);
});

for (const [credential, headers] of [
  ["no key", {}],
  ["a wrong key", { authorization: `Bearer ${WRONG_KEY}` }],
  ["a revoked key", "revoked"],
  ["a revoked key as X-API-Key", "revoked-x-api-key"],
] as const) {
  test(`every non-public route × every spelling of its path, with ${credential}, answers 401 over HTTP`, async () => {
    const auth: Record<string, string> = headers === "revoked" ? { authorization: `Bearer ${revokedKey}` } : headers === "revoked-x-api-key" ? { "x-api-key": revokedKey } : { ...headers };
    const cases = routesOf(["key", "envd-token", "e2b-volume-token", "e2b-upload", "edge-token", "cluster"]).flatMap((r) =>
      spellings(concrete(r.url)).map((s) => ({ r, s, extra: (r.constrained ? { "e2b-sandbox-id": SANDBOX } : {}) as Record<string, string> })),
    );
    const results = await inParallel(cases, 16, async ({ r, s, extra }) => ({ r, s, res: await rawRequest(port, r.method, s.target, { ...auth, ...extra }) }));
    for (const { r, s, res } of results) {
      // The edge answers /edge/<id> itself, before routing, with a redirect to /edge/<id>/ (for any id, revealing
      // nothing); the request that follows is the one that needs the edge token.
      const [path, query] = s.target.split("?");
      if (r.auth === "edge-token" && res.status === 308 && /^\/edge\/[^/]+$/.test(path)) {
        assert.ok(res.head.toLowerCase().includes(`\r\nlocation: ${path}/${query === undefined ? "" : "?" + query}\r\n`.toLowerCase()), res.head);
        continue;
      }
      assertRefused(res, `${r.method} ${r.url} as ${s.name} (${s.target}) with ${credential}`, r.method);
    }
    assert.ok(results.length > 3000, `${results.length} requests`);
  });
}

test("every route × every spelling of its path, as a WebSocket upgrade without a key (or with a revoked one), answers 401 and never 101", async () => {
  const cases = routesOf(["key", "envd-token", "e2b-volume-token", "edge-token", "cluster"])
    .filter((r) => r.method === "GET")
    .flatMap((r) =>
      spellings(concrete(r.url)).flatMap((s) =>
        // A browser's key rides in a subprotocol (the console): a revoked one there is refused like any other.
        ([{}, { authorization: `Bearer ${revokedKey}` }, { "sec-websocket-protocol": `kiln.v1, kiln.bearer.${Buffer.from(revokedKey).toString("base64url")}` }] as Record<string, string>[]).map((cred) => ({ r, s, headers: { ...UPGRADE_HEADERS, ...cred, ...(r.constrained ? { "e2b-sandbox-id": SANDBOX } : {}) } as Record<string, string> })),
      ),
    );
  const results = await inParallel(cases, 16, async ({ r, s, headers }) => ({ r, s, res: await rawRequest(port, "GET", s.target, headers) }));
  for (const { r, s, res } of results) assertRefused(res, `upgrade of ${r.url} as ${s.name} (${s.target})`);
});

test("the cluster port tunnel opens for no key and no forged signature: its own upgrade is refused 401, never 101", async () => {
  const forged = { "x-kiln-cluster-from": "h-x", "x-kiln-cluster-to": "h-y", "x-kiln-cluster-ts": String(Date.now()), "x-kiln-cluster-key": "", "x-kiln-cluster-nonce": "n", "x-kiln-cluster-sig": "AAAA" };
  const tunnel = { connection: "Upgrade", upgrade: "kiln-tunnel" };
  for (const s of spellings(concrete("/v1/cluster/machines/:id/ports/:port/tunnel"))) {
    const target = `${s.target}?use=pipe`;
    // Forged headers are refused on any path; a key on the spellings the router folds back onto the route (others are 404s).
    const withKey = /as registered|percent-encoded|absolute-form|lower-case hex/.test(s.name);
    for (const [what, headers] of [
      ...(withKey ? ([["a key", { ...tunnel, authorization: `Bearer ${TEST_KEY}` }]] as const) : []),
      ["forged cluster headers", { ...tunnel, ...forged }],
      ["forged cluster headers and a key", { ...tunnel, ...forged, authorization: `Bearer ${TEST_KEY}` }],
    ] as const) {
      assertRefused(await rawRequest(port, "GET", target, headers), `a tunnel upgrade of ${target} with ${what}`);
    }
  }
});

test("the spellings reach the route: with the key, the path tricks answer what the route answers (so the 401s above are the auth, not a 404)", async () => {
  const plain = routesOf(["key"]).filter((r) => r.method === "GET" && !r.url.includes(":") && !r.url.includes("*") && r.url.startsWith("/v1/") && !r.url.endsWith("/ws"));
  assert.ok(plain.length >= 6, plain.map((r) => r.url).join(" "));
  for (const r of plain) {
    for (const s of spellings(r.url).filter((x) => /percent-encoded|absolute-form|lower-case hex|trailing/.test(x.name))) {
      const res = await rawRequest(port, "GET", s.target, { authorization: `Bearer ${TEST_KEY}` });
      assert.equal(res.status, 200, `GET ${r.url} as ${s.name} (${s.target}) with the key → ${res.head.split("\r\n")[0]}`);
      const anon = await rawRequest(port, "GET", s.target);
      assert.equal(anon.status, 401, `GET ${r.url} as ${s.name} without a key`);
    }
  }
  // The machine socket's upgrade is reached the same way: with the key an unknown machine is a 404 envelope, not a 401.
  const ws = await rawRequest(port, "GET", "/%761/machines/mch_00000000000000000000000000/ws", { ...UPGRADE_HEADERS, authorization: `Bearer ${TEST_KEY}` });
  assert.equal(ws.status, 404, ws.head);
});

test("a key created through a path trick is refused, and no key was made (the reported /%761/keys bypass)", async () => {
  const before = (await k.call("GET", "/v1/keys")).body.keys.length;
  for (const target of ["/%761/keys", "http://x/v1/keys", "/v%31/keys", "/%76%31/%6b%65%79%73"]) {
    const res = await rawRequest(port, "POST", target, { "content-type": "application/json" }, '{"name":"x"}');
    assertRefused(res, `POST ${target}`);
  }
  assert.equal((await k.call("GET", "/v1/keys")).body.keys.length, before);
});

test("public routes stay public: /health and /v1/openapi.json answer without a key", async () => {
  for (const target of ["/health", "/v1/openapi.json", "http://kiln.test/health"]) {
    const res = await rawRequest(port, "GET", target);
    assert.equal(res.status, 200, `${target} → ${res.head}`);
  }
  const doc = await k.call("GET", "/v1/openapi.json", { key: null });
  assert.equal(doc.body.openapi, "3.1.0");
  assert.ok(doc.body.paths["/v1/machines"], "the public document still describes the API");
});

test("unknown paths without a key answer 401 (route existence is not revealed); with a key 404", async () => {
  for (const target of ["/v1/no-such", "/V1/machines", "/no-such", "/", "/v2/whatever", "/edgex/y"]) {
    assertRefused(await rawRequest(port, "GET", target), `GET ${target}`);
    assertRefused(await rawRequest(port, "DELETE", target), `DELETE ${target}`);
    const withKey = await rawRequest(port, "GET", target, { authorization: `Bearer ${TEST_KEY}` });
    assert.equal(withKey.status, 404, `GET ${target} with a key`);
  }
  // Methods no route has are unmatched requests too; CONNECT gets no answer at all.
  for (const method of ["OPTIONS", "PROPFIND", "TRACE", "M-SEARCH", "PURGE"]) assertRefused(await rawRequest(port, method, "/v1/keys"), `${method} /v1/keys`);
  assert.equal((await rawRequest(port, "CONNECT", "127.0.0.1:1")).status, 0);
  // A known path with another method is a 405 only for a key holder.
  assertRefused(await rawRequest(port, "PUT", "/v1/machines"), "PUT /v1/machines");
  assert.equal((await rawRequest(port, "PUT", "/v1/machines", { authorization: `Bearer ${TEST_KEY}` })).status, 405);
});

test("envd routes take only a token for that sandbox from a live key: another sandbox's, a revoked key's or a forged one is refused", async () => {
  const tokens = createTokens(await loadTokenSecret(k.kiln.services.store.db, k.dataDir));
  const liveKeyId = (await k.call("GET", "/v1/keys")).body.keys.find((x: any) => x.revoked_at === null).id;
  const post = (token: string | undefined, sandbox = SANDBOX) =>
    rawRequest(port, "POST", "/filesystem.Filesystem/Stat", { "e2b-sandbox-id": sandbox, "content-type": "application/json", ...(token ? { "x-access-token": token } : {}) }, '{"path":"/"}');
  for (const [what, token] of [
    ["no token", undefined],
    ["another sandbox's token", tokens.tokenOf("mch_11111111111111111111111111", liveKeyId)],
    ["a revoked key's token", tokens.tokenOf(SANDBOX, revokedKeyId)],
    ["a token naming another key", `${revokedKeyId}.${tokens.tokenOf(SANDBOX, liveKeyId).split(".")[1]}`],
    ["an API key as the token", TEST_KEY],
  ] as const) {
    const res = await post(token);
    assert.equal(res.status, 401, `${what}: ${res.head}`);
  }
  // The live key's token passes auth: the answer is about the (unknown) sandbox, not the credential.
  const ok = await post(tokens.tokenOf(SANDBOX, liveKeyId));
  assert.notEqual(ok.status, 401, ok.head + ok.body);
});

test("the edge's WebSocket route takes only an edge token, and a Kiln key is not one", async () => {
  for (const headers of [{}, { authorization: `Bearer ${TEST_KEY}` }, { cookie: "kiln_edge=forged" }] as Record<string, string>[]) {
    for (const target of ["/edge/svc_00000000000000000000000000/", "/%65dge/svc_00000000000000000000000000/x", "http://x/edge/svc_00000000000000000000000000/"]) {
      const res = await rawRequest(port, "GET", target, { ...UPGRADE_HEADERS, ...headers });
      assert.equal(res.status, 401, `${target} ${JSON.stringify(headers)} → ${res.head}`);
    }
  }
});

test("a route registered without an auth declaration stops the server from starting, a plugin's route included", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-authdecl-"));
  const store = await openStore({ dataDir: dir });
  try {
    const cases: [string, (app: App) => void | Promise<void>][] = [
      ["a plain route", (app) => void app.get("/v1/x", async () => "x")],
      ["an unknown kind", (app) => void app.get("/v1/x", { config: { auth: "maybe" as never } }, async () => "x")],
      ["a route in an encapsulated plugin", (app) => void app.register(async (child) => void child.post("/plugin/x", async () => "x"))],
      [
        "a WebSocket route",
        async (app) => {
          await app.register(websocket);
          app.get("/v1/socket", { websocket: true }, () => undefined);
        },
      ],
    ];
    for (const [what, add] of cases) {
      const app = Fastify() as unknown as App;
      createAuth(createKeyService(store.db)).install(app);
      app.get("/declared", { config: { auth: "none" } }, async () => "ok");
      await assert.rejects(
        (async () => {
          await add(app);
          await app.ready();
        })(),
        /declares no auth/,
        what,
      );
      await app.close().catch(() => undefined);
    }
  } finally {
    await store.close();
    await rm(dir, { recursive: true, force: true });
  }
});
