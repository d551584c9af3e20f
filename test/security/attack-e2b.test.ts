// Attacks on the E2B layer's additions, driven from outside with the published `e2b` SDK and raw requests: what a
// holder of a signed file URL (docs/e2b.md) can reach beyond what its signature covers.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { Sandbox } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";

let k: TestKiln;
let sbx: Sandbox;
/** The same sandbox as a client that reaches it by name: its URLs are `49983-<id>.<domain>`. */
let byDomain: Sandbox;

before(async () => {
  k = await startTestKiln({ env: { KILN_PUBLIC_URL: "http://kiln.test" } });
  const key = (await k.kiln.services.keys.create("attack-e2b", generateKeyIn("e2b"))).key;
  sbx = await Sandbox.create("base", { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 30_000, secure: true });
  byDomain = await Sandbox.connect(sbx.sandboxId, { apiKey: key, apiUrl: k.url, requestTimeoutMs: 30_000 });
});
after(async () => {
  await sbx?.kill().catch(() => undefined);
  await k?.close();
});

/** A URL the SDK made for `http://49983-<id>.kiln.test/…`, sent to Kiln with that Host and the extra headers. */
async function send(url: string, headers: Record<string, string>, method: "GET" | "HEAD" | "POST" = "GET", body?: Buffer) {
  const u = new URL(url);
  const res = await request(`${k.url}${u.pathname}${u.search}`, { method, headers: { host: u.host, ...headers }, body });
  return { status: res.statusCode, text: await res.body.text() };
}

const basic = (user: string) => ({ authorization: `Basic ${Buffer.from(`${user}:`).toString("base64")}` });

test("a signed URL acts only as the user it was signed for: a Basic header naming another user is refused", async () => {
  // The signer's user keeps a file in its home; root keeps one of the same name in its own.
  await sbx.files.write("secret.txt", "the user's");
  await sbx.files.write("/root/secret.txt", "root's only", { user: "root" });
  const read = await byDomain.downloadUrl("secret.txt", { user: "user" });
  assert.deepEqual(await send(read, {}), { status: 200, text: "the user's" });
  const asRoot = await send(read, basic("root"));
  assert.equal(asRoot.status, 401, `a read signed for user read ${JSON.stringify(asRoot.text)} as root`);
  assert.equal((await send(read, basic("user"))).status, 200, "the signed user named again is the same user");

  const write = await byDomain.uploadUrl("planted.txt", { user: "user" });
  const form = new Response((() => {
    const f = new FormData();
    f.append("file", new Blob(["planted"]), "planted.txt");
    return f;
  })());
  const bytes = Buffer.from(await form.arrayBuffer());
  const planted = await send(write, { ...basic("root"), "content-type": form.headers.get("content-type")! }, "POST", bytes);
  assert.equal(planted.status, 401, `a write signed for user wrote as root: ${planted.text}`);
  assert.equal(await sbx.files.exists("/root/planted.txt", { user: "root" }), false);
});

test("a write signature does not read: HEAD with it learns nothing of the file", async () => {
  await sbx.files.write("/home/user/sized.txt", "x".repeat(12345));
  const write = await byDomain.uploadUrl("/home/user/sized.txt", { user: "user" });
  const head = await send(write, {}, "HEAD");
  assert.equal(head.status, 401, "HEAD is a read");
  const read = await byDomain.downloadUrl("/home/user/sized.txt", { user: "user" });
  assert.equal((await send(read, {}, "HEAD")).status, 200);
});
