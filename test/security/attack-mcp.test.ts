// Attacks on MCP over HTTP in JSON response mode (docs/mcp.md), driven from outside with raw JSON-RPC: a key holder
// making one POST (a batch) hold more of Kiln's answers than the server can keep; a machine printing or storing
// what it likes (200 MB, binary, invalid UTF-8, hostile file names) for the tools to carry back.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

const HELD_MAX_MB = 16;
let k: TestKiln;
let machineId: string;

before(async () => {
  // The budget made small (KILN_MCP_HELD_MAX_MB; 128 by default), so that going past it costs seconds, not minutes.
  k = await startTestKiln({ env: { KILN_MCP_HELD_MAX_MB: String(HELD_MAX_MB) } });
  const m = await k.call("POST", "/v1/machines", { body: {} });
  assert.equal(m.status, 201, m.text);
  machineId = m.body.id;
});
after(async () => k?.close());

async function mcp(body: unknown) {
  const res = await request(`${k.url}/v1/mcp`, {
    method: "POST",
    headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json", accept: "application/json, text/event-stream", "mcp-protocol-version": "2025-06-18" },
    body: JSON.stringify(body),
  });
  const text = await res.body.text();
  // A slow answer comes as SSE `message` events, a quick one as the JSON itself.
  const messages = /^(:|event:)/.test(text) ? text.split("\n").filter((l) => l.startsWith("data: ")).map((l) => JSON.parse(l.slice(6))) : [JSON.parse(text)].flat();
  return { status: res.statusCode, messages: messages as { id: number; result?: { isError?: boolean; content: { type: string; text?: string }[] } }[] };
}

const runCode = (id: number, code: string) => ({ jsonrpc: "2.0", id, method: "tools/call", params: { name: "run_code", arguments: { machine_id: machineId, code } } });

test("a batch of run_code calls with 6 MB of images each is held only up to the server's budget: the rest answer 503 retryable", async () => {
  // Eight 0.75 MB "images" per call (run_code passes images through): four calls are more than the 16 MiB budget.
  const code = "from IPython.display import display\ns='A'*750_000\nfor i in range(8):\n    display({'image/png': s}, raw=True)\n";
  const calls = Math.ceil((HELD_MAX_MB * 1024 * 1024) / 6_000_000) + 1;
  const batch = await mcp(Array.from({ length: calls }, (_, i) => runCode(i + 1, code)));
  assert.equal(batch.status, 200);
  assert.equal(batch.messages.length, calls);
  const refused = batch.messages.filter((m) => m.result?.isError);
  const served = batch.messages.filter((m) => !m.result?.isError && m.result?.content.filter((c) => c.type === "image").length === 8);
  assert.ok(refused.length >= 1, "past the budget a call is refused rather than held");
  assert.ok(served.length >= 1, "within it calls are served whole");
  assert.equal(refused.length + served.length, calls);
  assert.match(refused[0].result!.content[0].text!, /try again/);
  // Given back once the answer is gone: the next call is served.
  const after = await mcp(runCode(99, "print('after')"));
  assert.equal(after.messages[0].result?.isError, undefined, JSON.stringify(after.messages[0]));
  assert.match(after.messages[0].result!.content[0].text!, /after/);
});

test("what a machine prints or stores (huge, binary, invalid UTF-8, hostile names) comes back bounded and well-formed, and the server stays up", async () => {
  const call = (id: number, name: string, args: Record<string, unknown>) => ({ jsonrpc: "2.0", id, method: "tools/call", params: { name, arguments: { machine_id: machineId, ...args } } });
  const prep = await mcp(call(1, "run_command", { command: "cd /workspace && head -c 3000000 /dev/urandom > bin && printf 'ok\\377\\376\\300\\200 end' > bad-utf8 && touch \"$(printf 'n\\033[31m<img src=x onerror=alert(1)>\\001')\" && echo done" }));
  assert.match(prep.messages[0].result!.content[0].text!, /done/, JSON.stringify(prep.messages[0]));
  const started = process.memoryUsage().rss;
  const batch = await mcp([
    // 200 MB on stdout and binary on stderr: cut to the tool's bound, start and end kept.
    call(2, "run_command", { command: "head -c 200000000 /dev/zero | tr '\\0' x; head -c 2000000 /dev/urandom >&2" }),
    call(3, "read_file", { path: "/workspace/bin" }),
    call(4, "read_file", { path: "/workspace/bad-utf8" }),
    call(5, "list_files", { path: "/workspace" }),
    call(6, "read_file", { path: "/workspace/../../../../etc/../proc/self/root/nope" }),
  ]);
  assert.equal(batch.status, 200);
  const byId = new Map(batch.messages.map((m) => [m.id, m]));
  const text = (id: number) => (byId.get(id)?.result?.content ?? []).map((c) => c.text ?? "").join("\n");
  assert.ok(text(2).length < 100_000, `run_command answered ${text(2).length} characters`);
  assert.match(text(2), /characters cut/);
  assert.ok(text(3).length < 1_000_000, `read_file of 3 MB answered ${text(3).length} characters`);
  assert.match(text(3), /longer than|Binary file/);
  assert.match(text(4), /^Binary file \(10 bytes\), base64:\n/, "invalid UTF-8 comes back as base64, not mangled text");
  assert.match(text(5), /img src=x/, "a hostile name is listed as text");
  assert.equal(byId.get(6)?.result?.isError, true);
  const all = JSON.stringify(batch.messages);
  assert.ok(!all.includes(k.dataDir) && !/\/(src|node_modules)\//.test(all), "an answer named the server's files");
  assert.ok(process.memoryUsage().rss - started < 512 * 1024 * 1024);
  assert.equal((await k.call("GET", "/health", { key: null })).status, 200);
});
