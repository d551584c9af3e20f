// Registry credentials and the distribution protocol's edges, against a real docker-registry with bcrypt htpasswd:
// basic, token and docker-config credentials; a bearer-token front with blobs redirected to another origin
// (Authorization must not follow) that cuts the first download halfway (resumed with Range); no secret in errors.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { createServer } from "node:http";
import type { IncomingMessage, Server, ServerResponse } from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { request } from "undici";
import { importImage } from "../../src/builder/oci/import.ts";
import type { BaseImageAuth } from "../../src/builder/oci/auth.ts";
import { pushImage, registryAvailable, startRegistry } from "../support/oci-registry.ts";
import type { TestRegistry } from "../support/oci-registry.ts";

const skip = registryAvailable();
const opt = { skip };
const password = `pw-${randomBytes(8).toString("hex")}`;
const preToken = `pre-${randomBytes(8).toString("hex")}`;
let reg: TestRegistry;
let cacheDir: string;
const servers: Server[] = [];

before(async () => {
  if (skip) return;
  reg = await startRegistry({ auth: { username: "kiln", password } });
  cacheDir = await mkdtemp(join(tmpdir(), "kiln-oci-auth-"));
  await pushImage(reg, "private/app", "v1", { layers: [{ entries: [{ name: "hello", content: "private\n" }] }] });
});

after(async () => {
  if (skip) return;
  for (const s of servers) await new Promise((r) => s.close(r));
  await reg.stop();
  await rm(cacheDir, { recursive: true, force: true });
});

const fresh = async () => mkdtemp(join(cacheDir, "c-"));

async function importWith(host: string, ref: string, auth: BaseImageAuth | undefined, alsoListed: string[] = []) {
  return importImage(`${host}/${ref}`, { cacheDir: await fresh(), insecureRegistries: [host, ...alsoListed], auth, arch: "amd64" });
}

async function failure(p: Promise<unknown>): Promise<string> {
  const err = await p.then(() => undefined, (e: Error & { detail?: { code?: string } }) => e);
  assert.ok(err, "the import must fail");
  assert.equal(err.detail?.code, "build_error");
  assert.ok(!err.message.includes(password) && !JSON.stringify(err.detail).includes(password), "no password in the error");
  return err.message;
}

test("a private image needs credentials: anonymous pulls are refused with a clear build_error", opt, async () => {
  assert.match(await failure(importWith(reg.host, "private/app:v1", undefined)), /requires a username and password \(base_image_auth\)/);
});

test("base_image_auth basic and docker_config pull a private image; a wrong password is refused without echoing it", opt, async () => {
  const basic = await importWith(reg.host, "private/app:v1", { type: "basic", username: "kiln", password });
  assert.equal(readFileSync(join(basic.layers[0].dir, "hello"), "utf8"), "private\n");
  const auth = Buffer.from(`kiln:${password}`).toString("base64");
  const viaObject = await importWith(reg.host, "private/app:v1", { type: "docker_config", config: { auths: { [reg.host]: { auth } } } });
  assert.equal(viaObject.layers[0].digest, basic.layers[0].digest);
  const viaString = await importWith(reg.host, "private/app:v1", { type: "docker_config", config: JSON.stringify({ auths: { [`http://${reg.host}`]: { username: "kiln", password } } }) });
  assert.equal(viaString.layers[0].digest, basic.layers[0].digest);
  assert.match(await failure(importWith(reg.host, "private/app:v1", { type: "basic", username: "kiln", password: `${password}-wrong` })), /refused access to private\/app \(401\)/);
});

/**
 * A registry front that speaks the bearer-token flow (as Docker Hub does) over the real registry, and sends layer
 * blobs to a second origin, which cuts each blob's first download halfway.
 */
async function bearerFront() {
  const seen = { scopes: [] as string[], blobAuth: [] as (string | undefined)[], ranges: [] as string[], tokenAuth: [] as string[] };
  const issued = `tok-${randomBytes(8).toString("hex")}`;
  const upstreamAuth = `Basic ${Buffer.from(`kiln:${password}`).toString("base64")}`;
  const cut = new Set<string>();
  const listen = (handler: (req: IncomingMessage, res: ServerResponse) => void) =>
    new Promise<number>((resolve) => {
      const s = createServer((req, res) => handler(req, res));
      servers.push(s);
      s.listen(0, "127.0.0.1", () => resolve((s.address() as { port: number }).port));
    });
  const blobPort = await listen(async (req, res) => {
    seen.blobAuth.push(req.headers.authorization);
    if (req.headers.range) seen.ranges.push(String(req.headers.range));
    const path = req.url!.replace(/^\/storage/, "/v2");
    const up = await request(`http://${reg.host}${path}`, { headers: { authorization: upstreamAuth, ...(req.headers.range ? { range: req.headers.range } : {}) } });
    const body = Buffer.from(await up.body.arrayBuffer());
    res.writeHead(up.statusCode, { "content-length": String(body.length), ...(up.headers["content-range"] ? { "content-range": String(up.headers["content-range"]) } : {}) });
    if (!cut.has(path) && body.length > 64) {
      cut.add(path);
      res.write(body.subarray(0, body.length >> 1), () => res.destroy());
      return;
    }
    res.end(body);
  });
  const port = await listen(async (req, res) => {
    const url = new URL(req.url!, "http://x");
    if (url.pathname === "/token") {
      seen.tokenAuth.push(String(req.headers.authorization));
      seen.scopes.push(String(url.searchParams.get("scope")));
      if (req.headers.authorization !== upstreamAuth) return res.writeHead(401).end();
      return res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify({ token: issued }));
    }
    const given = req.headers.authorization;
    if (given !== `Bearer ${issued}` && given !== `Bearer ${preToken}`) {
      const repo = url.pathname.split("/").slice(2, -2).join("/");
      res.writeHead(401, { "www-authenticate": `Bearer realm="http://127.0.0.1:${port}/token",service="kiln-test",scope="repository:${repo}:pull"` });
      return res.end();
    }
    if (/\/blobs\/sha256:/.test(url.pathname) && !url.pathname.endsWith("/blobs/uploads/")) {
      return res.writeHead(307, { location: `http://127.0.0.1:${blobPort}${url.pathname.replace(/^\/v2/, "/storage")}` }).end();
    }
    const up = await request(`http://${reg.host}${req.url}`, { headers: { authorization: upstreamAuth, accept: String(req.headers.accept ?? "") } });
    const body = Buffer.from(await up.body.arrayBuffer());
    res.writeHead(up.statusCode, { "content-type": String(up.headers["content-type"] ?? "") }).end(body);
  });
  return { host: `127.0.0.1:${port}`, blobHost: `127.0.0.1:${blobPort}`, seen };
}

test("bearer tokens come from the realm with the pull scope; blob redirects to another origin carry no Authorization; a cut download resumes with Range", opt, async () => {
  const front = await bearerFront();
  // The blob origin is on loopback too: reached only when KILN_INSECURE_REGISTRIES lists it (checked at connect time).
  assert.match(await failure(importWith(front.host, "private/app:v1", { type: "basic", username: "kiln", password })), /KILN_INSECURE_REGISTRIES/);
  assert.equal(front.seen.blobAuth.length, 0, "the unlisted blob origin was never contacted");
  const img = await importWith(front.host, "private/app:v1", { type: "basic", username: "kiln", password }, [front.blobHost]);
  assert.equal(readFileSync(join(img.layers[0].dir, "hello"), "utf8"), "private\n");
  assert.deepEqual([...new Set(front.seen.scopes)], ["repository:private/app:pull"]);
  assert.ok(front.seen.blobAuth.length >= 3, "config and layer went through the other origin (and a retry)");
  assert.deepEqual(front.seen.blobAuth.filter(Boolean), [], "no Authorization header reached the redirect target");
  assert.ok(front.seen.ranges.some((r) => /^bytes=[1-9]\d*-$/.test(r)), `a resumed download asked for the rest: ${front.seen.ranges}`);

  const withToken = await importWith(front.host, "private/app:v1", { type: "token", token: preToken }, [front.blobHost]);
  assert.equal(withToken.layers[0].digest, img.layers[0].digest, "a token credential is used as the registry's bearer token");
  assert.match(await failure(importWith(front.host, "private/app:v1", { type: "basic", username: "kiln", password: `${password}x` })), /refused the credentials for private\/app \(401\)/);
});
