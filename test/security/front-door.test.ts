// The front door under refusal: a blob over the body limit answers 413 and the server lives (twice over, declared
// and chunked), a form-encoded POST gets 415 with what to send, and while the first-start base template is being
// made /v1/ready answers 503 `unavailable` (retryable), expected refusals are logged at info, and base-template
// build dirs a killed server left are swept at start.

import { test, describe, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { createServer } from "node:http";
import type { IncomingMessage, Server, ServerResponse } from "node:http";
import { existsSync, mkdirSync, mkdtempSync, readFileSync } from "node:fs";
import { rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { rawRequest } from "./raw-http.ts";
import { sha256hex } from "../builds/support.ts";

describe("body limits and content types", () => {
  const LIMIT = 65536;
  let k: TestKiln;
  let port: number;
  before(async () => {
    k = await startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_BODY_LIMIT_BYTES: String(LIMIT) }, waitForBase: false });
    port = Number(new URL(k.url).port);
  });
  after(async () => k?.close());

  /** Streams `size` bytes to a blob upload as fast as the socket takes them, declared or chunked; resolves with the answer's status. */
  function upload(size: number, chunked: boolean): Promise<number> {
    return new Promise((resolve) => {
      const head = [`PUT /v1/templates/blobs/${"a".repeat(64)} HTTP/1.1`, "Host: kiln.test", `Authorization: Bearer ${TEST_KEY}`, "Content-Type: application/octet-stream"];
      head.push(chunked ? "Transfer-Encoding: chunked" : `Content-Length: ${size}`);
      import("node:net").then(({ connect }) => {
        const s = connect(port, "127.0.0.1");
        let answer = "";
        s.on("data", (d) => (answer += d));
        s.on("error", () => undefined);
        s.on("close", () => resolve(Number(/^HTTP\/1\.1 (\d{3})/.exec(answer)?.[1] ?? 0)));
        s.write(head.join("\r\n") + "\r\n\r\n");
        const chunk = Buffer.alloc(16384, 7);
        let sent = 0;
        const pump = () => {
          while (sent < size && !s.destroyed && !answer) {
            sent += chunk.length;
            if (!s.write(chunked ? Buffer.concat([Buffer.from(`${chunk.length.toString(16)}\r\n`), chunk, Buffer.from("\r\n")]) : chunk)) return void s.once("drain", pump);
          }
          if (chunked && !s.destroyed && !answer) s.write("0\r\n\r\n");
        };
        pump();
        setTimeout(() => s.destroy(), 15_000).unref();
      });
    });
  }

  test("a blob upload over the body limit answers 413 and the server lives, 2 of 2, declared and chunked", async () => {
    for (let i = 0; i < 2; i++) {
      assert.equal(await upload(LIMIT * 40, false), 413, `declared, attempt ${i + 1}`);
      assert.equal(await upload(LIMIT * 40, true), 413, `chunked, attempt ${i + 1}`);
    }
    // Alive, and a blob within the limit is still taken.
    assert.equal((await k.call("GET", "/health", { key: null })).status, 200);
    const small = Buffer.alloc(LIMIT - 1, 3);
    const put = await k.call("PUT", `/v1/templates/blobs/${sha256hex(small)}`, { raw: small, headers: { "content-type": "application/octet-stream" } });
    assert.equal(put.status, 201, put.text);
    // Blobs honour KILN_BODY_LIMIT_BYTES: one byte over is refused, by its declared length, with the envelope.
    const over = Buffer.alloc(LIMIT + 1, 3);
    const refused = await k.call("PUT", `/v1/templates/blobs/${sha256hex(over)}`, { raw: over, headers: { "content-type": "application/octet-stream" } });
    assert.equal(refused.status, 413);
    assert.equal(refused.body.code, "payload_too_large");
    assert.match(refused.body.error, /KILN_BODY_LIMIT_BYTES/);
    assert.equal((await k.call("GET", `/v1/templates/blobs/${sha256hex(over)}`)).status, 404, "nothing of the refused blob was kept");
  });

  test("a POST without the JSON content type (what curl -d sends) answers 415 and says what to send", async () => {
    for (const type of ["application/x-www-form-urlencoded", "text/plain"]) {
      const res = await rawRequest(port, "POST", "/v1/machines", { authorization: `Bearer ${TEST_KEY}`, "content-type": type }, "template=x");
      assert.equal(res.status, 415, res.head);
      const body = JSON.parse(res.body);
      assert.equal(body.code, "unsupported_media_type");
      assert.match(body.error, /send Content-Type: application\/json/);
      assert.ok(body.error.includes(type), body.error);
    }
  });
});

describe("first start: the base template is being made", () => {
  let k: TestKiln;
  let cacheDir: string;
  let mirror: Server;
  const held: ServerResponse[] = [];
  let staleDir: string;
  let liveDir: string;

  before(async () => {
    // A Debian mirror that holds every request until the test lets go: the base template stays "being made".
    mirror = createServer((_req: IncomingMessage, res: ServerResponse) => void held.push(res));
    await new Promise<void>((r) => mirror.listen(0, "127.0.0.1", r));
    cacheDir = mkdtempSync(join(tmpdir(), "kiln-cache-"));
    // What a server killed (kill -9) during its base-template build leaves: a build dir with /proc mounted in it,
    // its maker dead. And a build dir of a maker that is alive (this process), which must be left alone.
    const dead = spawnSync("true").pid;
    staleDir = join(cacheDir, "base", `.build-${dead}-1`);
    liveDir = join(cacheDir, "base", `.build-${process.pid}-2`);
    mkdirSync(join(staleDir, "layer", "proc"), { recursive: true });
    mkdirSync(liveDir, { recursive: true });
    assert.equal(spawnSync("mount", ["-t", "proc", "proc", join(staleDir, "layer", "proc")]).status, 0);
    const port = (mirror.address() as { port: number }).port;
    k = await startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_CACHE_DIR: cacheDir, KILN_DEBIAN_MIRROR: `http://127.0.0.1:${port}/debian` }, waitForBase: false });
  });
  after(async () => {
    for (const res of held.splice(0)) res.writeHead(404).end();
    mirror?.closeAllConnections();
    await new Promise((r) => mirror?.close(r));
    await k?.kiln.baseReady;
    await k?.close();
    spawnSync("umount", ["-l", join(staleDir, "layer", "proc")]);
    await rm(cacheDir, { recursive: true, force: true });
  });

  test("stale base-template build dirs of a dead server are swept at start (mounts first); a live one's are kept", async () => {
    for (let i = 0; i < 100 && existsSync(staleDir); i++) await new Promise((r) => setTimeout(r, 100));
    assert.equal(existsSync(staleDir), false, "the dead server's build dir is gone");
    assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(staleDir), "and its /proc mount with it");
    assert.equal(existsSync(liveDir), true, "a build dir whose maker lives is kept");
  });

  test("GET /v1/ready answers 503 unavailable (retryable) while the base template is made, and a create says the same", async () => {
    // The build has reached the mirror: the base template is being made now.
    for (let i = 0; i < 300 && held.length === 0; i++) await new Promise((r) => setTimeout(r, 100));
    assert.ok(held.length > 0, "debootstrap asked the mirror");
    const ready = await k.call("GET", "/v1/ready");
    assert.equal(ready.status, 503);
    assert.equal(ready.body.status, "not_ready");
    assert.equal(ready.body.code, "unavailable");
    assert.equal(ready.body.error_detail.retryable, true);
    assert.equal(ready.body.base_template.ready, false);
    assert.match(ready.body.base_template.reason, /being made/);
    assert.match(ready.body.error, /being made/);
    assert.equal(ready.body.store.ok, true, "the rest of the report is still there");

    const create = await k.call("POST", "/v1/machines", { body: {} });
    assert.equal(create.status, 503);
    assert.equal(create.body.code, "unavailable");
    // Expected refusals are logged at info, never as errors.
    const lines = k.logs.map((l) => JSON.parse(l));
    const refusal = lines.find((l) => l.reqId === create.body.request_id && l.msg === "request refused");
    assert.equal(refusal?.level, 30, JSON.stringify(refusal));
    assert.equal(lines.filter((l) => l.reqId === create.body.request_id && l.level >= 50).length, 0);
  });

  test("when making the base template fails, /v1/ready still answers 503 and says why", async () => {
    for (const res of held.splice(0)) res.writeHead(404).end();
    mirror.removeAllListeners("request");
    mirror.on("request", (_req, res: ServerResponse) => res.writeHead(404).end());
    await k.kiln.baseReady;
    const ready = await k.call("GET", "/v1/ready");
    assert.equal(ready.status, 503);
    assert.equal(ready.body.code, "unavailable");
    assert.match(ready.body.base_template.reason, /could not be made/);
  });
});
