// Public URLs people can share (issue 24, item 2): a deployment's access is `token` (default: a long-lived token, the
// same URL on every read, rotatable), `public` (no credential) or `signed` (fresh per read, expiring). Driven from
// outside: the API, the CLI, plain HTTP and WebSocket clients. The signed lifetime is shortened to 2 s
// (KILN_EDGE_TOKEN_TTL_S) so "an hour's worth of clock" passes in a few seconds.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { readFileSync, readdirSync, statSync } from "node:fs";
import { join } from "node:path";
import { promisify } from "node:util";
import { request } from "undici";
import { WebSocket } from "ws";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { appCommand, createDeployment, services, waitService } from "./support.ts";

const TTL_S = 2;
const run = promisify(execFile);
const KILN = join(import.meta.dirname, "..", "..", "bin", "kiln");

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_EDGE_TOKEN_TTL_S: String(TTL_S) } });
});
after(async () => {
  if (!k) return;
  const res = await k.call("GET", "/v1/agent-deployments");
  for (const d of res.body?.deployments ?? []) await k.call("DELETE", `/v1/agent-deployments/${d.id}`);
  await k.close();
});

const fast = { interval_s: 0.2, timeout_s: 1 };
const cli = (args: string[]) => run(KILN, args, { env: { ...process.env, KILN_URL: k.url, KILN_API_KEY: TEST_KEY } });

async function readyApp(body: Record<string, unknown>, port: number) {
  const dep = await createDeployment(k, { name: `access-${port}`, command: appCommand(port), port, readiness: { path: "/health", ...fast }, ...body });
  const [first] = await services(k, dep.id);
  const svc = await waitService(k, dep.id, first.id, (s) => s.status === "ready");
  return { dep, svc };
}

async function get(url: string, headers: Record<string, string> = {}) {
  const res = await request(url, { headers });
  return { status: res.statusCode, text: await res.body.text(), headers: res.headers };
}

/** The time for a signed token to be long past its expiry (its TTL, rounded up to whole seconds, and a margin). */
const pastSignedExpiry = () => new Promise((r) => setTimeout(r, (TTL_S + 1.5) * 1000));

function dataDirFiles(dir: string): string[] {
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
      if (name === "machines" || name === "cache" || name === "disks") continue; // machines' filesystems and disks: nothing of the edge goes there
      out.push(...dataDirFiles(p));
    } else if (st.isFile() && !["disk.img", "image.ext4", "disks.xfs"].includes(name)) out.push(p);
  }
  return out;
}

test("by default a service's public URL is the same on every read and still works after the signed lifetime has passed", async () => {
  const { dep, svc } = await readyApp({}, 8100);
  assert.equal(dep.access, "token");
  assert.match(dep.edge_url, new RegExp(`/edge/${dep.id}/\\?edge_token=kse_[A-Za-z0-9_-]{43}$`));
  assert.match(svc.public_url, new RegExp(`/edge/${svc.id}/\\?edge_token=kse_[A-Za-z0-9_-]{43}$`));
  const again = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  assert.equal(again.public_url, svc.public_url, "the next read gives the same URL");
  assert.equal((await k.call("GET", `/v1/agent-deployments/${dep.id}`)).body.edge_url, dep.edge_url);
  // The CLI a person uses prints the same URL each time.
  const line = async () => (await cli(["deployments", "services", dep.id, "--urls"])).stdout.trim().split("\t").pop();
  assert.equal(await line(), svc.public_url);
  assert.equal(await line(), svc.public_url);
  assert.equal((await cli(["deployments", "url", dep.id])).stdout.trim(), dep.edge_url);

  await pastSignedExpiry();
  for (const url of [svc.public_url, dep.edge_url]) {
    const res = await get(url.replace("/?", "/hello?"));
    assert.equal(res.status, 200, res.text);
    assert.match(res.text, /hello from \/hello/);
    assert.doesNotMatch(res.text, /edge_token|kse_/, "the token never reaches the service");
  }
  // A browser keeps it as a session cookie on the URL's own path (no Max-Age: it lives as long as the token).
  const first = await get(dep.edge_url);
  const cookie = String(first.headers["set-cookie"]);
  assert.match(cookie, new RegExp(`^kiln_edge=kse_[^;]+; Path=/edge/${dep.id}/; HttpOnly; SameSite=Lax$`));
  assert.equal((await get(new URL(`/edge/${dep.id}/style.css`, k.url).href, { cookie: cookie.split(";")[0] })).status, 200);
  // Without the token, or with another deployment's, or with a signed token, the URL is refused.
  const bare = `${new URL(dep.edge_url).origin}/edge/${dep.id}/`;
  for (const [name, u] of [
    ["none", bare],
    ["wrong", `${bare}?edge_token=kse_${"A".repeat(43)}`],
    ["short", `${bare}?edge_token=kse_x`],
  ]) {
    const res = await get(u);
    assert.equal(res.status, 401, name);
    assert.equal(JSON.parse(res.text).code, "unauthorized", name);
  }
});

test("the deployment's URL outlives a rollout: the same URL reaches the new replica", async () => {
  const { dep, svc } = await readyApp({}, 8101);
  assert.equal((await get(dep.edge_url.replace("/?", "/env/VERSION?"))).text, "");
  const patched = await k.call("PATCH", `/v1/agent-deployments/${dep.id}`, { body: { envs: { VERSION: "2" } } });
  assert.equal(patched.status, 200, patched.text);
  assert.equal(patched.body.edge_url, dep.edge_url);
  const deadline = Date.now() + 120_000;
  let fresh: any;
  while (Date.now() < deadline) {
    fresh = (await services(k, dep.id)).find((s) => s.id !== svc.id && s.status === "ready");
    const old = (await services(k, dep.id)).find((s) => s.id === svc.id);
    if (fresh && old?.status === "stopped") break;
    await new Promise((r) => setTimeout(r, 200));
  }
  assert.ok(fresh, "the new replica got ready");
  assert.equal(fresh.public_url.split("edge_token=")[1], svc.public_url.split("edge_token=")[1], "replicas share their deployment's token");
  const after = await get(dep.edge_url.replace("/?", "/env/VERSION?"));
  assert.equal(after.status, 200, after.text);
  assert.equal(after.text, "2", "the new version's replica answers on the same URL");
  assert.notEqual((await get(svc.public_url)).status, 200, "the old replica's own URL names a stopped service");
});

test("rotating the token stops the old URL at once (cookie and open WebSocket too); the new one works", async () => {
  const { dep, svc } = await readyApp({}, 8102);
  const oldCookie = String((await get(dep.edge_url)).headers["set-cookie"]).split(";")[0];
  const wsUrl = dep.edge_url.replace(/^http/, "ws").replace("/?", "/ws?");
  const ws = new WebSocket(wsUrl);
  await new Promise((resolve, reject) => {
    ws.once("open", resolve);
    ws.once("error", reject);
  });
  const echoed = new Promise<string>((r) => ws.once("message", (m) => r(String(m))));
  ws.send("before");
  assert.equal(await echoed, "before");
  const closed = new Promise((r) => ws.once("close", r));

  const rotated = (await cli(["deployments", "url", dep.id, "--rotate"])).stdout.trim();
  assert.notEqual(rotated, dep.edge_url);
  assert.match(rotated, new RegExp(`/edge/${dep.id}/\\?edge_token=kse_`));
  for (const u of [dep.edge_url, svc.public_url]) assert.equal((await get(u)).status, 401, "the old token is refused at once");
  assert.equal((await get(new URL(`/edge/${dep.id}/`, k.url).href, { cookie: oldCookie })).status, 401, "so is a cookie holding it");
  await closed; // the WebSocket it opened is cut
  assert.equal((await get(rotated)).status, 200);
  const now = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  assert.equal(now.public_url.split("edge_token=")[1], rotated.split("edge_token=")[1]);
  // Every rotation is a new token.
  const twice = await k.call("POST", `/v1/agent-deployments/${dep.id}/rotate-edge-token`);
  assert.equal(twice.status, 200, twice.text);
  assert.notEqual(twice.body.edge_url, rotated);
  assert.equal((await get(rotated)).status, 401);
  assert.equal((await k.call("POST", "/v1/agent-deployments/dep_nope/rotate-edge-token")).status, 404);
});

test("public access needs no token; switching access changes the URLs at once without a new version or rollout", async () => {
  const { dep, svc } = await readyApp({ access: "public" }, 8103);
  assert.equal(dep.access, "public");
  assert.equal(dep.edge_url, `${new URL(dep.edge_url).origin}/edge/${dep.id}/`);
  assert.equal(svc.public_url, `${new URL(svc.public_url).origin}/edge/${svc.id}/`);
  const res = await get(dep.edge_url + "hi");
  assert.equal(res.status, 200);
  assert.equal(res.headers["set-cookie"], undefined, "nothing to remember");

  const patched = await cli(["deployments", "update", dep.id, "--access", "token"]);
  assert.match(patched.stdout, /access token/);
  const after = (await k.call("GET", `/v1/agent-deployments/${dep.id}`)).body;
  assert.equal(after.version, 1, "no new version");
  assert.equal(after.rollout_status, "idle");
  assert.equal((await get(dep.edge_url)).status, 401, "the public URL now needs the token");
  assert.equal((await get(after.edge_url)).status, 200);
  const same = (await services(k, dep.id))[0];
  assert.equal(same.id, svc.id, "the same replica serves");
  assert.equal(same.process_id, svc.process_id);
});

test("signed access: a fresh URL per read that expires; its deployment has no stable URL", async () => {
  const { dep, svc } = await readyApp({ access: "signed" }, 8104);
  assert.equal(dep.edge_url, null);
  await assert.rejects(cli(["deployments", "url", dep.id]), (err: { stderr?: string }) => /no stable URL: its access is signed/.test(err.stderr ?? ""));
  await new Promise((r) => setTimeout(r, 1100)); // the next read is a second later: another expiry, another token
  const next = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  assert.notEqual(next.public_url, svc.public_url);
  assert.match(next.public_url, /edge_token=[0-9a-z]+\.[A-Za-z0-9_-]{43}$/);
  const served = await get(next.public_url);
  assert.equal(served.status, 200);
  assert.match(String(served.headers["set-cookie"]), /; Max-Age=[0-2]; HttpOnly/, "its cookie ends with the token");
  assert.equal((await get(new URL(`/edge/${dep.id}/?edge_token=${new URL(next.public_url).searchParams.get("edge_token")}`, k.url).href)).status, 401, "a signed token names one service, not the deployment");
  await pastSignedExpiry();
  const expired = await get(next.public_url);
  assert.equal(expired.status, 401);
  assert.equal(JSON.parse(expired.text).error_detail.details.reason, "expired");
});

test("deleting a deployment stops its URLs; without public_url there are none and any token is refused", async () => {
  const { dep, svc } = await readyApp({}, 8105);
  const token = new URL(dep.edge_url).searchParams.get("edge_token")!;
  assert.equal((await k.call("PATCH", `/v1/agent-deployments/${dep.id}`, { body: { public_url: false } })).status, 200);
  assert.equal((await k.call("GET", `/v1/agent-deployments/${dep.id}`)).body.edge_url, null);
  assert.equal((await get(dep.edge_url)).status, 401, "public_url false refuses the token at once");
  assert.equal((await get(svc.public_url)).status, 401);
  const del = await k.call("DELETE", `/v1/agent-deployments/${dep.id}`);
  assert.equal(del.status, 200);
  assert.equal((await get(`${new URL(dep.edge_url).origin}/edge/${dep.id}/?edge_token=${token}`)).status, 401);
});

test("the long-lived token never reaches the store, the data dir or the logs in the clear", async () => {
  const { dep, svc } = await readyApp({}, 8106);
  const token = new URL(dep.edge_url).searchParams.get("edge_token")!;
  assert.equal((await get(svc.public_url)).status, 200);
  assert.equal((await get(dep.edge_url.replace("/?", "/ws-less?"))).status, 200);
  await k.call("POST", `/v1/agent-deployments/${dep.id}/services/${svc.id}/restart`, { body: { reason: "marker" } });
  await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  const rotated = (await k.call("POST", `/v1/agent-deployments/${dep.id}/rotate-edge-token`)).body.edge_url as string;
  const second = new URL(rotated).searchParams.get("edge_token")!;
  assert.equal((await get(rotated)).status, 200);
  for (const t of [token, second]) {
    const files = dataDirFiles(k.dataDir).filter((f) => readFileSync(f).includes(t) || readFileSync(f).includes(t.slice(4)));
    assert.deepEqual(files, [], "no file of the data dir (the SQLite store included) holds the token");
    assert.ok(!k.logs.join("").includes(t.slice(4)), "no log line holds it");
  }
  assert.ok(k.logs.join("").includes(`/edge/${dep.id}/?edge_token=[Redacted]`), "the access lines show it redacted");
});
