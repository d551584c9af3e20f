// Pure parts of the E2B layer (Connect envelopes, which requests are envd requests, access tokens, key shapes)
// and its refusals on the wire: bad bodies get E2B's {code, message} or a Connect error, and change nothing.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { join } from "node:path";
import { promisify } from "node:util";
import { request } from "undici";
import { envelope, parseEnvelopedRequest, ConnectFailure, connectError } from "../../src/compat/e2b/connect.ts";
import { sandboxIdOf } from "../../src/compat/e2b/index.ts";
import { machineIdOf, sandboxIdOf as e2bIdOf } from "../../src/compat/e2b/ids.ts";
import { portTargetOf } from "../../src/compat/e2b/ports.ts";
import { createTokens } from "../../src/compat/e2b/token.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { KilnError } from "../../src/errors.ts";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

test("a Connect envelope is a flag byte, a big-endian length and the JSON, and parses back", () => {
  const frame = envelope(0x02, { error: { code: "not_found" } });
  assert.equal(frame[0], 0x02);
  assert.equal(frame.readUInt32BE(1), frame.length - 5);
  assert.deepEqual(parseEnvelopedRequest(envelope(0, { path: "/x" })), { path: "/x" });
  assert.throws(() => parseEnvelopedRequest(Buffer.from([0, 0, 0])), ConnectFailure);
  assert.throws(() => parseEnvelopedRequest(Buffer.from([0, 0, 0, 0, 9, 0x7b])), /truncated/);
  assert.throws(() => parseEnvelopedRequest(envelope(0, "text")), /JSON object/);
});

test("Kiln errors become the Connect codes the SDK branches on; internal ones say nothing", () => {
  assert.deepEqual(connectError(new KilnError("not_found", "No file /x")), { code: "not_found", message: "No file /x" });
  assert.equal(connectError(new KilnError("machine_not_running", "hibernated")).code, "unavailable");
  assert.deepEqual(connectError(new Error("secret detail")), { code: "internal", message: "internal error" });
});

test("an envd request names its sandbox by header or by a 49983-<sandbox id>. host; other ports are port requests", () => {
  const body = "01m8278fg8qnyqh9sw8rwsfk2b";
  const id = `mch_${body}`;
  // Sandbox ids are the machine id's body: a DNS label. Inside, the layer works on the machine id.
  assert.equal(e2bIdOf(id), body);
  assert.equal(machineIdOf(body), id);
  assert.equal(machineIdOf(id), id, "the mch_ spelling is taken too");
  assert.equal(machineIdOf("01M8278FG8QNYQH9SW8RWSFK2B"), undefined);
  assert.equal(machineIdOf("short"), undefined);
  assert.equal(sandboxIdOf({ headers: { "e2b-sandbox-id": body } }), id);
  assert.equal(sandboxIdOf({ headers: { "e2b-sandbox-id": "mch_a" } }), "mch_a", "a bad header id stays envd's, and is not found");
  assert.equal(sandboxIdOf({ headers: { host: `49983-${body}.kiln.example:8080` } }), id);
  assert.equal(sandboxIdOf({ headers: { host: `49983-${id}.kiln.example:8080` } }), id);
  assert.equal(sandboxIdOf({ headers: { host: `3000-${body}.kiln.example` } }), undefined);
  assert.equal(sandboxIdOf({ headers: { host: "127.0.0.1:8080" } }), undefined);
  // The code interpreter's port is Kiln's too: named by Host, never proxied into the machine.
  assert.equal(sandboxIdOf({ headers: { host: `49999-${body}.kiln.example` } }), id);
  assert.equal(portTargetOf(`49999-${body}.kiln.example`, [49983, 49999]), undefined);
  assert.deepEqual(portTargetOf(`3000-${body}.kiln.example`, [49983, 49999]), { port: 3000, sandboxId: id });
  assert.equal(portTargetOf(`49983-${body}.kiln.example`, [49983, 49999]), undefined);
  // A Kiln host that merely starts with digits and a dash is still Kiln's.
  assert.equal(portTargetOf("8080-kiln.example.com", [49983, 49999]), undefined);
  assert.equal(portTargetOf("70000-mch_01m8278fg8qnyqh9sw8rwsfk2b.x", [49983, 49999]), undefined);
});

test("access tokens are per sandbox and key, name their key, and are checked in constant time", () => {
  const t = createTokens(Buffer.alloc(32, 7));
  const a = t.tokenOf("mch_a", "key_one");
  assert.equal(t.verify("mch_a", a), "key_one");
  assert.equal(t.verify("mch_b", a), undefined);
  assert.equal(t.verify("mch_a", a.slice(0, -1)), undefined);
  assert.equal(t.verify("mch_a", undefined), undefined);
  // Another key's token differs, and naming another key in a token does not make it that key's.
  const b = t.tokenOf("mch_a", "key_two");
  assert.notEqual(b, a);
  assert.equal(t.verify("mch_a", "key_two" + a.slice(a.indexOf("."))), undefined);
  assert.notEqual(createTokens(Buffer.alloc(32, 8)).tokenOf("mch_a", "key_one"), a);
});

test("e2b-format keys match the SDK's ^e2b_[0-9a-f]+$ and differ every time", () => {
  const a = generateKeyIn("e2b");
  assert.match(a, /^e2b_[0-9a-f]{40}$/);
  assert.notEqual(generateKeyIn("e2b"), a);
  assert.match(generateKeyIn("kiln"), /^kiln_/);
});

let k: TestKiln;
before(async () => {
  k = await startTestKiln();
});
after(async () => k?.close());

test("POST /v1/keys with format e2b and `kiln keys create --format e2b` issue keys the E2B API accepts", async () => {
  const made = await k.call("POST", "/v1/keys", { body: { name: "sdk", format: "e2b" } });
  assert.equal(made.status, 201);
  assert.match(made.body.key, /^e2b_[0-9a-f]+$/);
  const list = await request(`${k.url}/v2/sandboxes`, { headers: { "x-api-key": made.body.key } });
  assert.equal(list.statusCode, 200);
  assert.deepEqual(await list.body.json(), []);
  const badFormat = await k.call("POST", "/v1/keys", { body: { name: "sdk", format: "aws" } });
  assert.equal(badFormat.status, 400);
  await k.stop();
  const { stdout } = await promisify(execFile)(join(import.meta.dirname, "..", "..", "bin", "kiln"), ["keys", "create", "--format", "e2b", "--name", "cli"], { env: { ...process.env, KILN_DATA_DIR: k.dataDir } });
  assert.match(stdout.trim(), /^e2b_[0-9a-f]{40}$/);
  k = await startTestKiln({ dataDir: k.dataDir });
  const again = await request(`${k.url}/v2/sandboxes`, { headers: { "x-api-key": stdout.trim() } });
  assert.equal(again.statusCode, 200);
  await again.body.dump();
});

test("bad control-plane requests get E2B's {code, message} and create nothing", async () => {
  const post = (body: string, key = TEST_KEY) => request(`${k.url}/sandboxes`, { method: "POST", headers: { "x-api-key": key, "content-type": "application/json" }, body });
  const cases: [string, number][] = [
    ["{", 400],
    ["[]", 400],
    ['{"templateID":"base","timeout":-1}', 400],
    ['{"templateID":"base","bogus":1}', 400],
    ['{"templateID":"base","autoPause":true,"autoPauseMemory":false}', 400],
    ['{"templateID":"no-such-template"}', 404],
    ['{"templateID":"base","metadata":{"a":{"b":1}}}', 400],
    ['{"templateID":"base","network":{"allowOut":["example.com"]}}', 400],
    ['{"templateID":"base","network":{"rules":{"api.example.com":[{"transform":{"headers":{"x":"y"}}}]}}}', 400],
    ['{"templateID":"base","volumeMounts":[{"name":"no-such-volume","path":"/mnt"}]}', 404],
    ['{"templateID":"base","mcp":{"github":{}}}', 400],
    ['{"templateID":"base","iam":{"aws":{}}}', 400],
  ];
  for (const [body, status] of cases) {
    const res = await post(body);
    const parsed = (await res.body.json()) as { code: number; message: string };
    assert.equal(res.statusCode, status, body);
    assert.equal(parsed.code, status);
    assert.equal(typeof parsed.message, "string");
  }
  const unauth = await post('{"templateID":"base"}', "e2b_ffff");
  assert.equal(unauth.statusCode, 401);
  assert.deepEqual(((await unauth.body.json()) as { code: number }).code, 401);
  for (const path of ["/sandboxes/00000000000000000000000000/logs", "/v2/sandboxes/00000000000000000000000000/logs", "/teams", "/v2/templates", "/v3/templates", "/secrets"]) {
    const res = await request(`${k.url}${path}`, { headers: { "x-api-key": TEST_KEY } });
    assert.equal(res.statusCode, 501, path);
    assert.match(((await res.body.json()) as { message: string }).message, /not supported by Kiln/);
  }
  const unservedNoKey = await request(`${k.url}/v2/templates`);
  assert.equal(unservedNoKey.statusCode, 401);
  await unservedNoKey.body.dump();
  const badList = await request(`${k.url}/v2/sandboxes?state=dead`, { headers: { "x-api-key": TEST_KEY } });
  assert.equal(badList.statusCode, 400);
  assert.equal(((await badList.body.json()) as { code: number }).code, 400);
  const none = await request(`${k.url}/sandboxes/mch_00000000000000000000000000`, { headers: { "x-api-key": TEST_KEY } });
  assert.equal(none.statusCode, 404);
  assert.equal(((await none.body.json()) as { code: number }).code, 404);
  assert.equal((await k.kiln.services.machines.list({ limit: 10 })).machines.length, 0);
});
