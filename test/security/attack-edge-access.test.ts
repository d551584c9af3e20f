// Service clients against issue 24's deployment access, with real services in real machines: a signed URL (and the
// cookie it left) that leaked stops when its deployment's token is rotated, like a `token` one; a deployment's token
// opens neither another deployment nor its services; path tricks after /edge/<id>/ never reach another service.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request as httpRequest } from "node:http";
import { request } from "undici";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { appCommand, createDeployment, services, waitService } from "../deployments/support.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => {
  if (!k) return;
  const res = await k.call("GET", "/v1/agent-deployments");
  for (const d of res.body?.deployments ?? []) await k.call("DELETE", `/v1/agent-deployments/${d.id}`);
  await k.close();
});

const fast = { interval_s: 0.2, timeout_s: 1 };

async function readyApp(name: string, body: Record<string, unknown>, port: number) {
  const dep = await createDeployment(k, { name, command: appCommand(port), port, readiness: { path: "/health", ...fast }, ...body });
  const [first] = await services(k, dep.id);
  const svc = await waitService(k, dep.id, first.id, (s) => s.status === "ready");
  return { dep, svc };
}

async function get(url: string, headers: Record<string, string> = {}) {
  const res = await request(url, { headers });
  return { status: res.statusCode, text: await res.body.text(), headers: res.headers };
}

/** A GET whose target goes on the wire exactly as written (no client folds its dot segments or decodes it). */
function rawGet(origin: string, path: string, headers: Record<string, string> = {}): Promise<{ status: number; text: string }> {
  return new Promise((resolve, reject) => {
    const req = httpRequest(origin, { path, headers }, (res) => {
      let text = "";
      res.setEncoding("utf8");
      res.on("data", (c: string) => (text += c));
      res.on("end", () => resolve({ status: res.statusCode ?? 0, text }));
    });
    req.on("error", reject);
    req.end();
  });
}

test("rotating a signed deployment's token stops the signed URLs already handed out, and their cookies, at once", async () => {
  const { dep, svc } = await readyApp("atk-signed-rotate", { access: "signed" }, 8201);
  const leaked = svc.public_url as string;
  const first = await get(leaked);
  assert.equal(first.status, 200, first.text);
  const cookie = String(first.headers["set-cookie"]).split(";")[0];
  assert.equal((await get(new URL(`/edge/${svc.id}/again`, k.url).href, { cookie })).status, 200, "the cookie works before the rotation");

  const rotated = await k.call("POST", `/v1/agent-deployments/${dep.id}/rotate-edge-token`);
  assert.equal(rotated.status, 200, rotated.text);
  const old = await get(leaked);
  assert.equal(old.status, 401, `a signed URL read before the rotation is refused after it: ${old.status} ${old.text.slice(0, 200)}`);
  assert.equal((await get(new URL(`/edge/${svc.id}/again`, k.url).href, { cookie })).status, 401, "so is the cookie it left");
  const fresh = await waitService(k, dep.id, svc.id, (s) => s.status === "ready" && s.public_url !== leaked);
  assert.equal((await get(fresh.public_url)).status, 200, "a URL read after the rotation works");
});

test("a deployment's token opens neither another deployment nor its services, and no path after /edge/<id>/ leaves that service", async () => {
  const a = await readyApp("atk-token-a", {}, 8202);
  const b = await readyApp("atk-token-b", {}, 8203);
  const tokenA = new URL(a.dep.edge_url).searchParams.get("edge_token")!;
  const origin = new URL(a.dep.edge_url).origin;
  for (const id of [b.dep.id, b.svc.id]) {
    const res = await get(`${origin}/edge/${id}/?edge_token=${tokenA}`);
    assert.equal(res.status, 401, `A's token on ${id}`);
    assert.equal(JSON.parse(res.text).error_detail.details.reason, "bad_token");
  }
  // Whatever follows /edge/<A>/ goes to A's service as written (it answers "hello from <path>"), never to B.
  for (const tail of [`../${b.dep.id}/`, `..%2f${b.dep.id}/`, `%2e%2e/${b.svc.id}/`, `/../../edge/${b.svc.id}/`]) {
    const res = await rawGet(origin, `/edge/${a.dep.id}/${tail}?edge_token=${tokenA}`);
    assert.equal(res.status, 200, tail);
    assert.match(res.text, /^hello from \//, tail);
  }
  // An id spelled another way is not an id: no redirect into B, no proxying.
  for (const spelled of [`%64ep_${b.dep.id.slice(4)}`, `${b.dep.id}%2f`, `${b.dep.id.toUpperCase()}`]) {
    const res = await rawGet(origin, `/edge/${spelled}/?edge_token=${tokenA}`);
    assert.notEqual(res.status, 200, spelled);
  }
  // B's own cookie, sent to A with A's path: A's cookie is scoped to /edge/<A>/ and B's token is not A's.
  const cookieB = String((await get(b.dep.edge_url)).headers["set-cookie"]).split(";")[0];
  assert.equal((await get(`${origin}/edge/${a.dep.id}/`, { cookie: cookieB })).status, 401);
});
