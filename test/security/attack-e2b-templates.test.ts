// A key holder attacks E2B's template builder (docs/e2b.md "Template builder") from outside, through the same calls
// the `e2b` SDK makes: an upload that decompresses without bound, and requested builds that starve every other key.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { gzipSync } from "node:zlib";
import { request } from "undici";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

const BODY_LIMIT = 64 * 1024;
let k: TestKiln;
before(async () => {
  k = await startTestKiln({ waitForBase: false, env: { KILN_BODY_LIMIT_BYTES: String(BODY_LIMIT) } });
});
after(async () => k?.close());

async function e2bKey(name: string): Promise<string> {
  const made = await k.call("POST", "/v1/keys", { body: { name, format: "e2b" } });
  assert.equal(made.status, 201);
  return made.body.key as string;
}

async function e2b(method: "GET" | "POST" | "PUT", path: string, key: string, body?: unknown) {
  const res = await request(path.startsWith("http") ? path : `${k.url}${path}`, {
    method,
    headers: { "x-api-key": key, ...(body !== undefined && !Buffer.isBuffer(body) ? { "content-type": "application/json" } : {}) },
    body: body === undefined ? undefined : Buffer.isBuffer(body) ? body : JSON.stringify(body),
  });
  const text = await res.body.text();
  return { status: res.statusCode, body: text ? JSON.parse(text) : undefined };
}

/** One 512-byte ustar header of a directory entry (the same block, repeated, gzips about a thousandfold). */
function dirHeader(name: string): Buffer {
  const h = Buffer.alloc(512);
  h.write(name, 0);
  h.write("0000755\0", 100);
  h.write("0000000\0", 108);
  h.write("0000000\0", 116);
  h.write("00000000000\0", 124);
  h.write("00000000000\0", 136);
  h.write("        ", 148);
  h.write("5", 156);
  h.write("ustar\0", 257);
  h.write("00", 263);
  let sum = 0;
  for (const b of h) sum += b;
  h.write(sum.toString(8).padStart(6, "0") + "\0 ", 148);
  return h;
}

test("an upload that gunzips past 10 x the body limit (a gzip bomb of tar headers) is refused with 413, not unpacked", async () => {
  const key = await e2bKey("bomber");
  const requested = await e2b("POST", "/v3/templates", key, { name: "bomb-target" });
  assert.equal(requested.status, 202, JSON.stringify(requested.body));
  const { templateID, buildID } = requested.body as { templateID: string; buildID: string };
  const hash = "a".repeat(64);
  const link = await e2b("GET", `/templates/${templateID}/files/${hash}`, key);
  assert.equal(link.status, 200);
  // 12 MiB of directory headers (plus the end-of-archive blocks): far past 10 x 64 KiB once gunzipped, yet the
  // gzip itself fits under the body limit.
  const header = dirHeader("d/");
  const tarBytes = Buffer.concat([Buffer.concat(Array.from({ length: 24 * 1024 }, () => header)), Buffer.alloc(1024)]);
  const bomb = gzipSync(tarBytes, { level: 9 });
  assert.ok(bomb.length < BODY_LIMIT, `the bomb gzips to ${bomb.length} bytes`);
  const put = await request(link.body.url as string, { method: "PUT", body: bomb });
  await put.body.dump();
  assert.equal(put.statusCode, 200, "the upload itself is within the limit");
  const started = await e2b("POST", `/v2/templates/${templateID}/builds/${buildID}`, key, { fromTemplate: "base", steps: [{ type: "COPY", args: ["d", "/tmp/d"], filesHash: hash }] });
  assert.equal(started.status, 413, JSON.stringify(started.body));
  assert.match(started.body.message, /unpacks to more than/);
});

test("one key's requested builds cannot fill the pending table for every other key", async () => {
  const greedy = await e2bKey("greedy");
  const other = await e2bKey("other");
  let refused: { status: number; body: any } | undefined;
  for (let i = 0; i < 1000 && !refused; i++) {
    const r = await e2b("POST", "/v3/templates", greedy, { name: `greedy-${i}` });
    if (r.status !== 202) refused = r;
  }
  assert.ok(refused, "a single key is held to its own share of requested builds");
  assert.equal(refused.status, 503);
  assert.match(refused.body.message, /this key/);
  const theirs = await e2b("POST", "/v3/templates", other, { name: "other-one" });
  assert.equal(theirs.status, 202, "another key can still request a build");
});
