// A hostile git remote against git credentials: credentials go only to the remote URL's own scheme+host(+port).
// A real machine runs git against a Node server on host loopback that answers as a git remote would (401 with
// Basic, 302 redirects) and records every Authorization header it is sent, with the host it was sent to.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { createServer } from "node:http";
import type { Server } from "node:http";
import type { AddressInfo } from "node:net";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

/** The machine's two names for host loopback: one the remote URL names, one a redirect leads to. */
const OWN_HOST = "host.kiln.internal";
const OTHER_HOST = "10.0.2.2";

let k: TestKiln;
let remote: Server;
let port: number;
let m: any;
/** Every request that carried credentials: the Host it was sent to and the decoded user:password. */
const seen: { host: string; path: string; credentials: string }[] = [];

before(async () => {
  remote = createServer((req, res) => {
    const host = String(req.headers.host ?? "");
    const path = req.url ?? "/";
    const auth = String(req.headers.authorization ?? "");
    if (auth.startsWith("Basic ")) seen.push({ host, path, credentials: Buffer.from(auth.slice(6), "base64").toString() });
    const repo = path.split("/")[1];
    const toOther = `http://${OTHER_HOST}:${port}/victim.git/info/refs?service=git-upload-pack`;
    // redirect-first.git: the first request is sent to another host, before any credentials were asked for.
    if (repo === "redirect-first.git" && host.startsWith(OWN_HOST)) return void res.writeHead(302, { location: toOther }).end();
    // redirect-after-auth.git: asks for credentials, then sends the authenticated request to another host.
    if (repo === "redirect-after-auth.git" && host.startsWith(OWN_HOST) && auth) return void res.writeHead(302, { location: toOther }).end();
    res.writeHead(401, { "www-authenticate": 'Basic realm="hostile"', "content-type": "text/plain" }).end("unauthorized\n");
  });
  await new Promise<void>((r) => remote.listen(0, "127.0.0.1", r));
  port = (remote.address() as AddressInfo).port;
  k = await startTestKiln({ env: { KILN_MACHINE_HOST_ACCESS: "1", KILN_WARM_POOL: "0" } });
  const res = await k.call("POST", "/v1/machines", { body: {} });
  assert.equal(res.status, 201, res.text);
  m = res.body;
});
after(async () => {
  await k?.close();
  if (remote) {
    remote.closeAllConnections();
    await new Promise((r) => remote.close(r));
  }
});

const git = (op: string, body: Record<string, unknown>) => k.call("POST", `/v1/machines/${m.id}/git/${op}`, { body: { timeout_s: 60, ...body } });
const leakedTo = (password: string, hostPrefix: string) => seen.filter((s) => s.credentials.includes(password) && s.host.startsWith(hostPrefix));

test("git credentials go only to the remote URL's own origin: a remote that redirects to another host never receives them", async () => {
  for (const repo of ["redirect-first.git", "redirect-after-auth.git"]) {
    const password = `marker-${randomUUID()}`;
    const auth = { kind: "https", username: "u", password };
    const clone = await git("clone", { url: `http://${OWN_HOST}:${port}/${repo}`, path: `/workspace/${repo}`, auth });
    assert.equal(clone.status, 422, `${repo}: ${clone.text}`);
    assert.equal(clone.body.error_detail.details.reason, "auth_failed", clone.text);
    assert.deepEqual(leakedTo(password, OTHER_HOST), [], `${repo}: the redirect's target received the credentials`);
    assert.ok(!clone.text.includes(password));
  }
});

test("git credentials go to the remote's own origin (the recorder sees them): named remote, URL remote, fetch, pull and push", async () => {
  await k.call("POST", `/v1/machines/${m.id}/exec`, {
    body: { cmd: `git init -q -b main /workspace/r && cd /workspace/r && git remote add origin http://${OWN_HOST}:${port}/plain.git && git remote add other http://${OTHER_HOST}:${port}/plain.git && git -c user.name=a -c user.email=a@b commit -q --allow-empty -m first`, user: "user" },
  });
  const cases: [string, Record<string, unknown>, string][] = [
    ["fetch", {}, OWN_HOST],
    ["pull", {}, OWN_HOST],
    ["fetch", { remote: "other" }, OTHER_HOST],
    ["push", { remote: `http://${OTHER_HOST}:${port}/plain.git`, branch: "main" }, OTHER_HOST],
  ];
  for (const [op, extra, expected] of cases) {
    const password = `marker-${randomUUID()}`;
    const res = await git(op, { path: "/workspace/r", auth: { kind: "https", username: "u", password }, ...extra });
    assert.equal(res.status, 422, res.text);
    assert.ok(leakedTo(password, expected).length > 0, `${op} ${JSON.stringify(extra)}: its own remote ${expected} was sent the credentials`);
    const elsewhere = expected === OWN_HOST ? OTHER_HOST : OWN_HOST;
    assert.deepEqual(leakedTo(password, elsewhere), []);
  }
});

test("git credentials holding a line break are refused (400) before git runs", async () => {
  const before = seen.length;
  const res = await git("clone", { url: `http://${OWN_HOST}:${port}/plain.git`, path: "/workspace/nl", auth: { kind: "https", username: "u", password: "a\nhost=evil" } });
  assert.equal(res.status, 400, res.text);
  assert.equal(seen.length, before);
});
