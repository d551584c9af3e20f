// Signed file URLs (`downloadUrl`/`uploadUrl` of a secure sandbox, `useSignatureExpiration`) through the published
// `e2b` SDK against a real Kiln: the URL the SDK makes is fetched with no token, as a browser or another service would,
// through the `49983-<sandbox id>.<domain>` name it carries (wildcard DNS in front of Kiln, emulated by the Host).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readdir, readFile } from "node:fs/promises";
import { join } from "node:path";
import { request } from "undici";
import { Sandbox } from "e2b";
import type { SandboxOpts } from "e2b";
import { filesWithContents } from "../support/files.ts";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";

let k: TestKiln;
let opts: SandboxOpts;
let sbx: Sandbox;
/** The same sandbox as a client without E2B_SANDBOX_URL sees it: its URLs name `49983-<id>.<domain>`. */
let byDomain: Sandbox;

before(async () => {
  // Kiln reports KILN_PUBLIC_URL's host as the sandboxes' domain (docs/e2b.md).
  k = await startTestKiln({ env: { KILN_PUBLIC_URL: "http://kiln.test" }, captureLogs: true });
  const key = (await k.kiln.services.keys.create("e2b-signed", generateKeyIn("e2b"))).key;
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 30_000 };
  sbx = await Sandbox.create("base", { ...opts, secure: true });
  byDomain = await Sandbox.connect(sbx.sandboxId, { apiKey: key, apiUrl: k.url, requestTimeoutMs: 30_000 });
});
after(async () => k?.close());

/** Fetches a URL the SDK made for `https://49983-<id>.<domain>/…` from Kiln, with that name as the Host. */
function fetchAs(url: string, init: { method?: "GET" | "POST"; body?: FormData } = {}) {
  const u = new URL(url);
  assert.equal(u.host, `49983-${sbx.sandboxId}.kiln.test`);
  if (!init.body) return request(`${k.url}${u.pathname}${u.search}`, { method: init.method ?? "GET", headers: { host: u.host } });
  const encoded = new Response(init.body);
  return encoded.arrayBuffer().then((bytes) =>
    request(`${k.url}${u.pathname}${u.search}`, { method: "POST", headers: { host: u.host, "content-type": encoded.headers.get("content-type")! }, body: Buffer.from(bytes) }),
  );
}

test("downloadUrl gives a signed URL that reads the file without the access token", async () => {
  await sbx.files.write("/home/user/report.txt", "signed read");
  const url = await byDomain.downloadUrl("/home/user/report.txt");
  assert.match(new URL(url).searchParams.get("signature") ?? "", /^v1_[A-Za-z0-9+/]+$/);
  const res = await fetchAs(url);
  assert.equal(res.statusCode, 200);
  assert.equal(await res.body.text(), "signed read");
  // A relative path is the user's home, signed as written.
  const rel = await fetchAs(await byDomain.downloadUrl("report.txt"));
  assert.equal(await rel.body.text(), "signed read");
});

test("uploadUrl gives a signed URL that writes the file (multipart POST) without the access token", async () => {
  const url = await byDomain.uploadUrl("/home/user/uploaded.txt");
  const form = new FormData();
  form.append("file", new Blob(["signed write"]), "uploaded.txt");
  const res = await fetchAs(url, { method: "POST", body: form });
  assert.equal(res.statusCode, 200, await res.body.text());
  assert.equal(await sbx.files.read("/home/user/uploaded.txt"), "signed write");
});

test("useSignatureExpiration: a URL works until it expires, then answers 401", async () => {
  await sbx.files.write("/home/user/soon.txt", "x");
  const live = await byDomain.downloadUrl("/home/user/soon.txt", { useSignatureExpiration: 60 });
  assert.ok(new URL(live).searchParams.get("signature_expiration"));
  assert.equal((await fetchAs(live)).statusCode, 200);
  const expired = await byDomain.downloadUrl("/home/user/soon.txt", { useSignatureExpiration: -10 });
  const res = await fetchAs(expired);
  assert.equal(res.statusCode, 401);
  assert.match(await res.body.text(), /expired/);
});

test("a signature is good only for its path, operation, user and sandbox; without one /files answers 401", async () => {
  await sbx.files.write("/home/user/a.txt", "a");
  await sbx.files.write("/home/user/b.txt", "b");
  const url = new URL(await byDomain.downloadUrl("/home/user/a.txt"));
  const refused = async (u: URL, method: "GET" | "POST" = "GET") => {
    const res = await fetchAs(u.toString(), { method });
    await res.body.dump();
    assert.equal(res.statusCode, 401, `${method} ${u}`);
  };
  const otherPath = new URL(url);
  otherPath.searchParams.set("path", "/home/user/b.txt");
  await refused(otherPath);
  const otherUser = new URL(url);
  otherUser.searchParams.set("username", "root");
  await refused(otherUser);
  await refused(url, "POST"); // a read signature does not write
  const unsigned = new URL(url);
  unsigned.searchParams.delete("signature");
  await refused(unsigned);
  const tampered = new URL(url);
  tampered.searchParams.set("signature", "v1_" + "A".repeat(43));
  await refused(tampered);
  const extended = new URL(url);
  extended.searchParams.set("signature_expiration", String(Math.floor(Date.now() / 1000) + 3600));
  await refused(extended); // an expiration the signature did not cover
  // Another sandbox's files with this sandbox's signature.
  const other = await Sandbox.create("base", opts);
  try {
    const res = await request(`${k.url}${url.pathname}${url.search}`, { headers: { host: `49983-${other.sandboxId}.kiln.test` } });
    await res.body.dump();
    assert.equal(res.statusCode, 401);
  } finally {
    await other.kill();
  }
});

test("a signed URL dies with the key whose sandbox token signed it", async () => {
  const { id, key } = await k.kiln.services.keys.create("e2b-signed-revoked", generateKeyIn("e2b"));
  const mine = await Sandbox.connect(sbx.sandboxId, { apiKey: key, apiUrl: k.url, requestTimeoutMs: 30_000 });
  await sbx.files.write("/home/user/r.txt", "r");
  const url = await mine.downloadUrl("/home/user/r.txt");
  assert.equal((await fetchAs(url)).statusCode, 200);
  await k.kiln.services.keys.revoke(id);
  const res = await fetchAs(url);
  await res.body.dump();
  assert.equal(res.statusCode, 401);
});

test("a signed URL's signature reaches neither the logs nor the data dir", async () => {
  await sbx.files.write("/home/user/quiet.txt", "q");
  const url = await byDomain.downloadUrl("/home/user/quiet.txt");
  const signature = new URL(url).searchParams.get("signature")!;
  const res = await fetchAs(url);
  assert.equal(res.statusCode, 200);
  await res.body.dump();
  const bad = await fetchAs(url.replace(encodeURIComponent(signature), encodeURIComponent(signature.slice(0, -2) + "AA")));
  await bad.body.dump();
  assert.ok(k.logs.join("").includes("/files"), "the requests were logged");
  assert.ok(!k.logs.join("").includes(signature.slice(3)), "the signature is not");
  for await (const { path, text } of filesWithContents(k.dataDir)) assert.ok(!text.includes(signature.slice(3)), `${path} holds the signature`);
});
