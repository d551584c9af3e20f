// Agent deployments through the API and the public edge: a real HTTP service reaches ready, its public URL proxies
// HTTP (a 50 MB streamed download too) and WebSocket, tokens are checked, restarts carry request-only envs that are
// stored nowhere, crashes end failed, and a rolling update keeps some replica answering throughout.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { readFileSync, readdirSync, statSync } from "node:fs";
import { join } from "node:path";
import { Client, request } from "undici";
import { createServer as createHttpServer, request as httpRequest } from "node:http";
import type { AddressInfo } from "node:net";
import { WebSocket } from "ws";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { appCommand, createDeployment, services, waitService } from "./support.ts";
import { loadEdgeSecret, signEdgeToken } from "../../src/deployments/edge-tokens.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_SERVICE_MAX_CRASHES: "3", KILN_SERVICE_BACKOFF_MS: "50", KILN_WEBHOOK_ALLOW_PRIVATE: "1" } });
});
after(async () => {
  if (!k) return;
  const res = await k.call("GET", "/v1/agent-deployments");
  for (const d of res.body?.deployments ?? []) await k.call("DELETE", `/v1/agent-deployments/${d.id}`);
  await k.close();
});

const fast = { interval_s: 0.2, timeout_s: 1 };

/** Every file under a directory, for greps of the whole data dir (the SQLite store included). */
function allFiles(dir: string): string[] {
  const out: string[] = [];
  for (const name of readdirSync(dir)) {
    const p = join(dir, name);
    let st;
    try {
      st = statSync(p);
    } catch {
      continue;
    }
    if (st.isDirectory()) {
      if (name === "machines" || name === "cache" || name === "disks") continue; // machine root filesystems, the base template, machines' disk images (the pool)
      out.push(...allFiles(p));
    } else if (st.isFile() && !["disk.img", "image.ext4", "disks.xfs"].includes(name)) out.push(p); // sockets and FIFOs hold no data; sparse disk images are searched where mounted
  }
  return out;
}

function dataDirContains(marker: string): string[] {
  return allFiles(k.dataDir).filter((f) => readFileSync(f).includes(marker));
}

test("a python3 -m http.server deployment reaches ready; public_url is null while it starts", async () => {
  const dep = await createDeployment(k, { name: "static", command: "python3 -m http.server 8000", port: 8000, readiness: fast });
  assert.match(dep.id, /^dep_/);
  assert.equal(dep.versions.length, 1);
  const [svc] = await services(k, dep.id);
  assert.match(svc.id, /^svc_/);
  assert.equal(svc.status, "starting");
  assert.equal(svc.public_url, null);
  assert.match(svc.machine_id, /^mch_/);
  assert.equal(typeof svc.process_id, "number");
  const ready = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  assert.match(ready.public_url, /\/edge\/svc_[^/]+\/\?edge_token=/);
  assert.equal(ready.readiness_status.probe, "tcp");
  assert.ok(ready.readiness_status.attempts >= 1);
  const res = await request(ready.public_url);
  assert.equal(res.statusCode, 200);
  assert.match(await res.body.text(), /Directory listing/);
});

let app: { dep: any; svc: any } | undefined;
/** One deployment of the Python app, shared by the proxy tests. */
async function theApp() {
  if (app) return app;
  const dep = await createDeployment(k, { name: "app", command: appCommand(8080), port: 8080, readiness: { ...fast, path: "/health" } });
  const [first] = await services(k, dep.id);
  const svc = await waitService(k, dep.id, first.id, (s) => s.status === "ready");
  app = { dep, svc };
  return app;
}

test("the public URL answers HTTP through the edge proxy; the token and the edge cookie never reach the service", async () => {
  const { svc } = await theApp();
  assert.equal(svc.readiness_status.probe, "http");
  assert.equal(svc.readiness_status.last_status_code, 200);
  const url = new URL(svc.public_url);
  const res = await request(`${url.origin}${url.pathname}some/page?x=1&edge_token=${url.searchParams.get("edge_token")}`);
  assert.equal(res.statusCode, 200);
  assert.equal(await res.body.text(), "hello from /some/page query x=1");
  const cookie = String(res.headers["set-cookie"]);
  // A long-lived token (the default access) makes a session cookie; a signed one's carries its Max-Age (access.test.ts).
  assert.match(cookie, new RegExp(`^kiln_edge=[^;]+; Path=/edge/${svc.id}/; HttpOnly; SameSite=Lax`));

  // A browser's later relative request carries only the cookie.
  const jar = cookie.split(";")[0];
  const viaCookie = await request(`${url.origin}/edge/${svc.id}/headers`, { headers: { cookie: `${jar}; theirs=1` } });
  assert.equal(viaCookie.statusCode, 200);
  const seen = await viaCookie.body.text();
  assert.match(seen, /^cookie: theirs=1$/m, "the service's own cookies pass");
  assert.doesNotMatch(seen, /kiln_edge|edge_token/, "Kiln's credentials are not forwarded");
  assert.match(seen, /^x-forwarded-proto: http$/m);

  // POST bodies stream to the service.
  const body = Buffer.alloc(3 * 1024 * 1024, 7);
  const posted = await request(`${url.origin}/edge/${svc.id}/upload`, { method: "POST", headers: { cookie: jar }, body });
  assert.equal(await posted.body.text(), createHash("sha256").update(body).digest("hex"));

  // The target reaches the service as written: no re-encoding, no folding of dot segments.
  const client = new Client(url.origin);
  const raw = await client.request({ method: "GET", path: `/edge/${svc.id}/a/../b%20c?q=a+b%2Fc&edge_token=${url.searchParams.get("edge_token")}&z` });
  assert.equal(await raw.body.text(), "hello from /a/../b%20c query q=a+b%2Fc&z");
  await client.close();

  // curl's Expect: 100-continue is answered on the client's hop and the body still streams through.
  const expected = await new Promise<string>((resolve, reject) => {
    const r = httpRequest(`${url.origin}/edge/${svc.id}/upload`, { method: "POST", headers: { cookie: jar, expect: "100-continue", "content-length": "3" } });
    r.once("continue", () => r.end("abc"));
    r.once("response", (res) => {
      let text = "";
      res.on("data", (d: Buffer) => (text += d));
      res.on("end", () => resolve(text));
    });
    r.once("error", reject);
  });
  assert.equal(expected, createHash("sha256").update("abc").digest("hex"));

  // /edge/<id> without the slash goes to the directory, keeping the query.
  const bare = await request(`${url.origin}/edge/${svc.id}?edge_token=x`);
  assert.equal(bare.statusCode, 308);
  assert.equal(bare.headers.location, `/edge/${svc.id}/?edge_token=x`);
  await bare.body.dump();
});

test("a 50 MB download streams through the public URL", async () => {
  const { svc } = await theApp();
  const url = new URL(svc.public_url);
  url.pathname += "big";
  url.searchParams.set("mb", "50");
  const res = await request(url);
  assert.equal(res.statusCode, 200);
  assert.equal(res.headers["content-length"], String(50 * 1024 * 1024));
  const hash = createHash("sha256");
  let bytes = 0;
  for await (const chunk of res.body) {
    hash.update(chunk);
    bytes += chunk.length;
  }
  assert.equal(bytes, 50 * 1024 * 1024);
  const chunk = Buffer.from(Array.from({ length: 256 }, (_, i) => i));
  const want = createHash("sha256");
  for (let i = 0; i < 50 * 4096; i++) want.update(chunk);
  assert.equal(hash.digest("hex"), want.digest("hex"));
});

test("a WebSocket echo works through the public URL", async () => {
  const { svc } = await theApp();
  const url = new URL(svc.public_url);
  url.protocol = "ws:";
  url.pathname += "ws";
  const ws = new WebSocket(url);
  await new Promise((resolve, reject) => {
    ws.once("open", resolve);
    ws.once("error", reject);
  });
  const big = Buffer.alloc(200_000, 1);
  const got: Buffer[] = [];
  const done = new Promise<void>((resolve) =>
    ws.on("message", (m: Buffer) => {
      got.push(m);
      if (got.length === 2) resolve();
    }),
  );
  ws.send("hello edge");
  ws.send(big);
  await done;
  assert.equal(got[0].toString(), "hello edge");
  assert.ok(got[1].equals(big));
  ws.close();
});

test("a wrong, expired or other service's edge token is refused with 401", async () => {
  const { svc } = await theApp();
  const url = new URL(svc.public_url);
  const base = `${url.origin}/edge/${svc.id}/`;
  const secret = await loadEdgeSecret(k.dataDir);
  const cases = {
    none: base,
    wrong: `${base}?edge_token=${"a".repeat(8)}.${"b".repeat(43)}`,
    expired: `${base}?edge_token=${signEdgeToken(secret, svc.id, Date.now() - 1000)}`,
    other: `${base}?edge_token=${signEdgeToken(secret, "svc_someoneelse", Date.now() + 60_000)}`,
    cookie: base,
  };
  for (const [name, u] of Object.entries(cases)) {
    const headers = name === "cookie" ? { cookie: `kiln_edge=${signEdgeToken(secret, "svc_other", Date.now() + 60_000)}` } : {};
    const res = await request(u, { headers });
    const body = (await res.body.json()) as any;
    assert.equal(res.statusCode, 401, name);
    assert.equal(body.code, "unauthorized", name);
    assert.match(body.request_id, /^req_/);
  }
  const ws = new WebSocket(`ws://${url.host}/edge/${svc.id}/ws?edge_token=nope`);
  const status = await new Promise<number>((resolve) => ws.once("unexpected-response", (_req, res) => resolve(res.statusCode ?? 0)));
  assert.equal(status, 401);
  // A bearer API key is not an edge credential.
  const withKey = await k.call("GET", `/edge/${svc.id}/`);
  assert.equal(withKey.status, 401);
});

test("restart with envs: the process sees them; the store, the events and the logs never do", async () => {
  const { dep, svc } = await theApp();
  const marker = `kiln-marker-${Date.now()}-${Math.random().toString(36).slice(2)}`;
  const res = await k.call("POST", `/v1/agent-deployments/${dep.id}/services/${svc.id}/restart`, { body: { reason: "rotate", envs: { SECRET_MARKER: marker } } });
  assert.equal(res.status, 200, res.text);
  assert.equal(res.body.id, svc.id);
  assert.equal(res.body.status, "starting");
  assert.equal(res.body.public_url, null);
  assert.notEqual(res.body.process_id, svc.process_id);
  assert.equal(res.body.readiness_status.restarts.count, 1);
  assert.equal(res.body.readiness_status.restarts.last_reason, "rotate");
  assert.equal(res.body.readiness_status.attempts, 0, "the probe's record starts over with the new process");
  assert.equal(res.body.readiness_status.last_ok_at, undefined);
  assert.equal(res.body.idempotency_key, null);
  const ready = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  const env = await request(new URL(`env/SECRET_MARKER?edge_token=${new URL(ready.public_url).searchParams.get("edge_token")}`, ready.public_url.split("?")[0]));
  assert.equal(await env.body.text(), marker);
  // The token itself is stored nowhere either.
  const token = new URL(ready.public_url).searchParams.get("edge_token")!;
  const events = await k.kiln.services.store.db.selectFrom("events").select(["operation", "payload_json"]).where("machine_id", "=", svc.machine_id).orderBy("seq").execute();
  assert.ok(events.some((e) => e.operation === "service.restart"));
  assert.ok(events.some((e) => e.operation === "service.ready"));
  for (const e of events) assert.ok(!e.payload_json.includes(marker));
  const logs = await k.call("GET", `/v1/agent-deployments/${dep.id}/services/${svc.id}/logs`);
  assert.equal(logs.status, 200);
  assert.match(logs.body.output, /restarting on request/);
  assert.deepEqual(dataDirContains(marker), []);
  assert.deepEqual(dataDirContains(token), []);
  assert.ok(!k.logs.join("").includes(marker), "the marker is in the server's logs");
  assert.ok(!k.logs.join("").includes(token), "the edge token is in the server's logs");
  assert.ok(k.logs.join("").includes("edge_token=[Redacted]"), "the access log line shows the redacted token");
});

test("restart envs must be an object of strings: anything else is 400 invalid_request and restarts nothing", async () => {
  const { dep, svc } = await theApp();
  const before = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  for (const envs of [{ A: 1 }, { A: true }, { A: null }, { A: { b: "c" } }, { A: ["x"] }, ["A"], "A=1"]) {
    const res = await k.call("POST", `/v1/agent-deployments/${dep.id}/services/${svc.id}/restart`, { body: { envs } });
    assert.equal(res.status, 400, JSON.stringify(envs));
    assert.equal(res.body.code, "invalid_request");
  }
  const unknown = await k.call("POST", `/v1/agent-deployments/${dep.id}/services/${svc.id}/restart`, { body: { reason: "x", extra: 1 } });
  assert.equal(unknown.status, 400);
  const after = await k.call("GET", `/v1/agent-deployments/${dep.id}/services/${svc.id}`);
  assert.equal(after.body.process_id, before.process_id);
  assert.equal(after.body.status, "ready");
});

test("a restart repeated with the same Idempotency-Key answers the first result without restarting again", async () => {
  const { dep, svc } = await theApp();
  await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  const key = `idem-${Date.now()}`;
  const first = await k.call("POST", `/v1/agent-deployments/${dep.id}/services/${svc.id}/restart`, { body: { reason: "once" }, headers: { "idempotency-key": key } });
  assert.equal(first.status, 200, first.text);
  assert.equal(first.body.idempotency_key, key);
  await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  const again = await k.call("POST", `/v1/agent-deployments/${dep.id}/services/${svc.id}/restart`, { body: { reason: "once" }, headers: { "idempotency-key": key } });
  assert.equal(again.status, 200);
  assert.equal(again.body.process_id, first.body.process_id);
  assert.equal(again.body.idempotency_key, key);
  assert.deepEqual(again.body.readiness_status.restarts, first.body.readiness_status.restarts);
  const now = await k.call("GET", `/v1/agent-deployments/${dep.id}/services/${svc.id}`);
  assert.equal(now.body.process_id, first.body.process_id, "no second restart happened");
  assert.equal(now.body.readiness_status.restarts.count, first.body.readiness_status.restarts.count);
});

test("a ready service whose probe fails turns unhealthy (public_url null) and ready again when it recovers", async () => {
  const { dep, svc } = await theApp();
  await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  const exec = (cmd: string) => k.call("POST", `/v1/machines/${svc.machine_id}/exec`, { body: { cmd } });
  assert.equal((await exec("touch /tmp/unhealthy")).status, 200);
  const sick = await waitService(k, dep.id, svc.id, (s) => s.status === "unhealthy");
  assert.equal(sick.public_url, null);
  assert.equal(sick.readiness_status.last_status_code, 503);
  assert.match(sick.readiness_status.last_error, /answered 503/);
  await exec("rm /tmp/unhealthy");
  const well = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  assert.equal(well.process_id, sick.process_id, "the probe never restarts the process");
  assert.ok(well.public_url);
  const ops = (await k.kiln.services.store.db.selectFrom("events").select("operation").where("machine_id", "=", svc.machine_id).orderBy("seq").execute()).map((e) => e.operation);
  assert.deepEqual(ops.slice(-2), ["service.unhealthy", "service.ready"]);
});

test("a deployment with public_url false never gives its ready services a URL", async () => {
  const dep = await createDeployment(k, { name: "private", command: "python3 -m http.server 8003", port: 8003, public_url: false, readiness: fast });
  assert.equal(dep.public_url, false);
  const [svc] = await services(k, dep.id);
  const ready = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  assert.equal(ready.public_url, null);
  // Allowing it later (an update) gives the ready services one: the permission is the deployment's.
  const patched = await k.call("PATCH", `/v1/agent-deployments/${dep.id}`, { body: { public_url: true } });
  assert.equal(patched.status, 200);
  const deadline = Date.now() + 60_000;
  let withUrl: any;
  while (Date.now() < deadline && !withUrl) {
    withUrl = (await services(k, dep.id)).find((s) => s.status === "ready" && s.public_url);
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.ok(withUrl, "a ready service got a public URL");
  // The edge may learn of the service's route a moment after its record says ready (seen on gVisor in a full run):
  // a 503 there is retryable and is waited out, within a bound.
  let status = 0;
  for (const until = Date.now() + 10_000; ; ) {
    const res = await request(withUrl.public_url);
    status = res.statusCode;
    await res.body.dump();
    if (status !== 503 || Date.now() > until) break;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.equal(status, 200);
  await k.call("DELETE", `/v1/agent-deployments/${dep.id}`);
});

test("deployment envs reach the process, are sealed at rest and shown by name only", async () => {
  const marker = `dep-env-${Date.now()}-${Math.random().toString(36).slice(2)}`;
  const dep = await createDeployment(k, { name: "with-envs", command: appCommand(8086), port: 8086, envs: { DEP_MARKER: marker }, readiness: { ...fast, path: "/health" } });
  assert.deepEqual(dep.env_names, ["DEP_MARKER"]);
  assert.equal(JSON.stringify(dep).includes(marker), false);
  const [svc] = await services(k, dep.id);
  const ready = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  const res = await request(ready.public_url.replace("/?", "/env/DEP_MARKER?"));
  assert.equal(await res.body.text(), marker);
  assert.deepEqual(dataDirContains(marker), []);
  assert.ok(!k.logs.join("").includes(marker));
  const coerced = await k.call("POST", "/v1/agent-deployments", { body: { name: "x", template: "local/base", command: "true", port: 80, envs: { A: 1 } } });
  assert.equal(coerced.status, 400, "a number is not a string, even where Ajv would coerce it");
  await k.call("DELETE", `/v1/agent-deployments/${dep.id}`);
});

test("a crashing command ends failed with a reason after its retries", async () => {
  const dep = await createDeployment(k, { name: "crasher", command: "echo boom; exit 3", port: 9000, readiness: fast });
  const [svc] = await services(k, dep.id);
  const failed = await waitService(k, dep.id, svc.id, (s) => s.status === "failed");
  assert.match(failed.failure_reason, /exited 3 times in a row \(last: code 3\)/);
  assert.equal(failed.public_url, null);
  assert.equal(failed.readiness_status.crashes, 3);
  const logs = await k.call("GET", `/v1/agent-deployments/${dep.id}/services/${svc.id}/logs`);
  assert.equal(logs.body.output.match(/boom/g)?.length, 3);
  const ops = (await k.kiln.services.store.db.selectFrom("events").select("operation").where("machine_id", "=", svc.machine_id).orderBy("seq").execute()).map((e) => e.operation);
  assert.deepEqual(ops.filter((o) => o.startsWith("service.")), ["service.starting", "service.failed"]);
  // A failed service can be restarted: it starts again (and here fails again, with a fresh crash streak).
  const again = await k.call("POST", `/v1/agent-deployments/${dep.id}/services/${svc.id}/restart`, { body: { reason: "try again" } });
  assert.equal(again.status, 200, again.text);
  assert.equal(again.body.status, "starting");
  assert.equal(again.body.failure_reason, null);
  const refailed = await waitService(k, dep.id, svc.id, (s) => s.status === "failed");
  assert.equal(refailed.readiness_status.crashes, 6);
});

test("a service whose machine is destroyed by hand ends failed, and cannot be restarted without it (409)", async () => {
  const dep = await createDeployment(k, { name: "orphan", command: "python3 -m http.server 8004", port: 8004, readiness: fast });
  const [svc] = await services(k, dep.id);
  await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  assert.equal((await k.call("DELETE", `/v1/machines/${svc.machine_id}`)).status, 200);
  const failed = await waitService(k, dep.id, svc.id, (s) => s.status === "failed");
  assert.match(failed.failure_reason, /backing machine .* is not running/);
  assert.equal(failed.public_url, null);
  await k.call("DELETE", `/v1/agent-deployments/${dep.id}`);
  const stopped = await k.call("POST", `/v1/agent-deployments/${dep.id}/services/${svc.id}/restart`, { body: {} });
  assert.equal(stopped.status, 409);
});

test("the OpenAPI document lists the Agent Deployments routes, the restart with its Idempotency-Key header, and no edge route", async () => {
  const doc = (await k.call("GET", "/v1/openapi.json")).body;
  const restart = doc.paths["/v1/agent-deployments/{deployment_id}/services/{service_id}/restart"]?.post;
  assert.ok(restart, "the restart path");
  assert.deepEqual(restart.tags, ["Agent Deployments"]);
  assert.ok(restart.parameters.some((p: any) => p.in === "header" && p.name === "idempotency-key"));
  for (const path of ["/v1/agent-deployments", "/v1/agent-deployments/{deployment_id}", "/v1/agent-deployments/{deployment_id}/services", "/v1/agent-deployments/{deployment_id}/services/{service_id}/logs"]) assert.ok(doc.paths[path], path);
  assert.ok(!Object.keys(doc.paths).some((p) => p.startsWith("/edge")));
});

test("service status changes reach lifecycle webhooks subscribed to them (service.ready, service.stopped)", async () => {
  const got: any[] = [];
  const receiver = createHttpServer((req, res) => {
    let body = "";
    req.on("data", (d: Buffer) => (body += d));
    req.on("end", () => {
      got.push({ headers: req.headers, body: JSON.parse(body) });
      res.end("ok");
    });
  });
  await new Promise<void>((r) => receiver.listen(0, "127.0.0.1", r));
  try {
    const url = `http://127.0.0.1:${(receiver.address() as AddressInfo).port}/hook`;
    const hook = await k.call("POST", "/v1/lifecycle/webhooks", { body: { url, operations: ["service.ready", "service.stopped"] } });
    assert.equal(hook.status, 201, hook.text);
    const dep = await createDeployment(k, { name: "hooked", command: "python3 -m http.server 8006", port: 8006, readiness: fast });
    const [svc] = await services(k, dep.id);
    await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
    await k.call("DELETE", `/v1/agent-deployments/${dep.id}`);
    for (let i = 0; i < 200 && got.filter((g) => g.body.service?.id === svc.id).length < 2; i++) await new Promise((r) => setTimeout(r, 50));
    const mine = got.filter((g) => g.body.service?.id === svc.id);
    assert.deepEqual(mine.map((g) => g.body.operation), ["service.ready", "service.stopped"]);
    assert.equal(mine[0].headers["x-service-webhook-id"], hook.body.id);
    assert.equal(mine[0].body.service.public_url, null, "a URL with a token never goes into an event");
    assert.equal(mine[0].body.service.machine_id, svc.machine_id);
    await k.call("DELETE", `/v1/lifecycle/webhooks/${hook.body.id}`);
  } finally {
    receiver.close();
  }
});

test("port must be 1–65535, fields are checked, and an unknown template is 404", async () => {
  for (const port of [0, 65536, -1]) {
    const res = await k.call("POST", "/v1/agent-deployments", { body: { name: "x", template: "local/base", command: "true", port } });
    assert.equal(res.status, 400, String(port));
    assert.equal(res.body.code, "invalid_request");
  }
  const extra = await k.call("POST", "/v1/agent-deployments", { body: { name: "x", template: "local/base", command: "true", port: 80, surprise: 1 } });
  assert.equal(extra.status, 400);
  const missing = await k.call("POST", "/v1/agent-deployments", { body: { name: "x", template: "local/nope", command: "true", port: 80 } });
  assert.equal(missing.status, 404);
  const none = await k.call("GET", "/v1/agent-deployments/dep_nope/services");
  assert.equal(none.status, 404);
  const noKey = await k.call("GET", "/v1/agent-deployments", { key: null });
  assert.equal(noKey.status, 401);
});

test("a rolling update (PATCH) keeps some replica answering throughout, and the old ones stop once the new ones are ready", async () => {
  const dep = await createDeployment(k, { name: "rolling", command: appCommand(8081), port: 8081, replicas: 2, readiness: { ...fast, path: "/health" } });
  const first = await services(k, dep.id);
  assert.equal(first.length, 2);
  for (const s of first) await waitService(k, dep.id, s.id, (x) => x.status === "ready");
  const urls = (await services(k, dep.id)).map((s) => s.public_url as string);
  let stop = false;
  let ok = 0;
  let failures = 0;
  const loop = (async () => {
    while (!stop) {
      // A client that tries each known URL in turn counts one answered round.
      let answered = false;
      for (const u of urls) {
        const res = await request(new URL("health", u.split("?")[0]) + "?" + u.split("?")[1]).catch(() => undefined);
        if (res) await res.body.dump();
        if (res?.statusCode === 200) {
          answered = true;
          break;
        }
      }
      if (answered) ok++;
      else failures++;
      // New replicas' URLs join the rotation as they get them.
      const now = await services(k, dep.id);
      for (const s of now) if (s.public_url && !urls.some((u) => u.includes(s.id))) urls.push(s.public_url);
    }
  })();
  const patched = await k.call("PATCH", `/v1/agent-deployments/${dep.id}`, { body: { command: appCommand(8081) + " # v2" } });
  assert.equal(patched.status, 200, patched.text);
  assert.equal(patched.body.versions.length, 2);
  assert.equal(patched.body.version, 2);
  const deadline = Date.now() + 120_000;
  let d = patched.body;
  while (Date.now() < deadline) {
    d = (await k.call("GET", `/v1/agent-deployments/${dep.id}`)).body;
    if (d.rollout_status !== "rolling") break;
    await new Promise((r) => setTimeout(r, 200));
  }
  stop = true;
  await loop;
  assert.equal(d.rollout_status, "idle", JSON.stringify(d));
  // Each new replica was ready when the rollout moved on; a probe on a loaded host may miss once since (unhealthy
  // for a moment), so the look waits for both to answer again.
  const fresh = (await services(k, dep.id)).filter((s) => s.version_id === d.current_version_id && s.status !== "stopped" && s.status !== "failed");
  assert.equal(fresh.length, 2, JSON.stringify(fresh));
  for (const s of fresh) await waitService(k, dep.id, s.id, (x) => x.status === "ready");
  const all = await services(k, dep.id);
  const live = all.filter((s) => s.status === "ready");
  assert.equal(live.length, 2);
  assert.ok(live.every((s) => s.version_id === d.current_version_id));
  const old = all.filter((s) => s.version_id !== d.current_version_id);
  assert.equal(old.length, 2);
  assert.ok(old.every((s) => s.status === "stopped" && s.stopped_at && s.public_url === null));
  for (const s of old) {
    const m = await k.call("GET", `/v1/machines/${s.machine_id}`);
    assert.equal(m.body.status, "destroyed");
  }
  assert.ok(ok > 3, `the client loop ran (${ok} rounds)`);
  assert.equal(failures, 0, "a round in which no replica answered");
});

test("a rollout whose new replica fails stops there and the old replica keeps serving; a newer update supersedes a stuck one", async () => {
  const dep = await createDeployment(k, { name: "careful", command: "python3 -m http.server 8005", port: 8005, readiness: fast });
  const [orig] = await services(k, dep.id);
  await waitService(k, dep.id, orig.id, (s) => s.status === "ready");
  const rolloutDone = async () => {
    for (let i = 0; i < 600; i++) {
      const d = (await k.call("GET", `/v1/agent-deployments/${dep.id}`)).body;
      if (d.rollout_status !== "rolling") return d;
      await new Promise((r) => setTimeout(r, 100));
    }
    assert.fail("the rollout did not end");
  };
  assert.equal((await k.call("PATCH", `/v1/agent-deployments/${dep.id}`, { body: { command: "exit 1" } })).status, 200);
  const failed = await rolloutDone();
  assert.equal(failed.rollout_status, "failed");
  assert.match(failed.rollout_error, /did not become ready \(the process exited 3 times in a row/);
  assert.equal((await k.call("GET", `/v1/agent-deployments/${dep.id}/services/${orig.id}`)).body.status, "ready", "the old replica still serves");

  // An update whose replica never listens is superseded by the next one at once, not after the readiness timeout.
  assert.equal((await k.call("PATCH", `/v1/agent-deployments/${dep.id}`, { body: { command: "sleep 600" } })).status, 200);
  const stuck = await (async () => {
    for (let i = 0; i < 600; i++) {
      const s = (await services(k, dep.id)).find((x) => x.status === "starting");
      if (s) return s;
      await new Promise((r) => setTimeout(r, 50));
    }
    assert.fail("no replica of the stuck version started");
  })();
  const started = Date.now();
  assert.equal((await k.call("PATCH", `/v1/agent-deployments/${dep.id}`, { body: { command: "python3 -m http.server 8005" } })).status, 200);
  const done = await rolloutDone();
  assert.equal(done.rollout_status, "idle", JSON.stringify(done));
  assert.ok(Date.now() - started < 60_000);
  const all = await services(k, dep.id);
  assert.equal((await k.call("GET", `/v1/agent-deployments/${dep.id}/services/${stuck.id}`)).body.status, "stopped");
  assert.equal((await k.call("GET", `/v1/agent-deployments/${dep.id}/services/${orig.id}`)).body.status, "stopped");
  assert.deepEqual(all.filter((s) => s.status === "ready").map((s) => s.version_id), [done.current_version_id]);
  // The failed replica of the first update keeps its record, but its machine went with the successful rollout.
  const failedReplica = all.find((s) => s.status === "failed")!;
  assert.equal((await k.call("GET", `/v1/machines/${failedReplica.machine_id}`)).body.status, "destroyed");
  await k.call("DELETE", `/v1/agent-deployments/${dep.id}`);
});

test("DELETE stops every service and destroys their machines", async () => {
  const dep = await createDeployment(k, { name: "doomed", command: "python3 -m http.server 8002", port: 8002, readiness: fast });
  const [svc] = await services(k, dep.id);
  await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  const res = await k.call("DELETE", `/v1/agent-deployments/${dep.id}`);
  assert.equal(res.status, 200, res.text);
  assert.equal(res.body.status, "deleted");
  const [after] = await services(k, dep.id);
  assert.equal(after.status, "stopped");
  assert.equal(after.process_id, null);
  assert.equal((await k.call("GET", `/v1/machines/${svc.machine_id}`)).body.status, "destroyed");
  const ops = (await k.kiln.services.store.db.selectFrom("events").select("operation").where("machine_id", "=", svc.machine_id).orderBy("seq").execute()).map((e) => e.operation);
  assert.deepEqual(ops.filter((o) => o.startsWith("service.")), ["service.starting", "service.ready", "service.stopping", "service.stopped"]);
  const list = await k.call("GET", "/v1/agent-deployments");
  assert.ok(!list.body.deployments.some((d: any) => d.id === dep.id));
});
