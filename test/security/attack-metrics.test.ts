// Attacks on GET /metrics (docs/metrics.md) and on MCP's door (POST /v1/mcp, docs/mcp.md), with one server and no
// machine: a stranger in every spelling; a key holder trying to grow the label sets without bound or to write lines
// into the exposition through what it names (paths, methods, ids, template and machine names); MCP methods without
// a key, bodies past the limit and batches.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { rawRequest } from "./raw-http.ts";

const BODY_LIMIT = 256 * 1024;
let k: TestKiln;
let port: number;
before(async () => {
  k = await startTestKiln({ waitForBase: false, env: { KILN_BODY_LIMIT_BYTES: String(BODY_LIMIT) } });
  port = Number(new URL(k.url).port);
});
after(async () => k?.close());

const auth = { authorization: `Bearer ${TEST_KEY}` };

async function scrape(): Promise<string> {
  const res = await k.call("GET", "/metrics");
  assert.equal(res.status, 200);
  return res.text;
}

/** Every series of one metric, as its label text (`{…}`). */
function series(text: string, name: string): Set<string> {
  return new Set(text.split("\n").filter((l) => l.startsWith(name + "{")).map((l) => l.slice(name.length, l.lastIndexOf("}") + 1)));
}

test("a stranger gets no metrics, in any spelling of the path", async () => {
  for (const target of ["/metrics", "/metrics/", "/METRICS", "/%6detrics", "//metrics", "/./metrics", "/v1/../metrics", `http://127.0.0.1:${port}/metrics`, "/metrics?x=1", "/metrics%00"]) {
    const r = await rawRequest(port, "GET", target, { host: `127.0.0.1:${port}` });
    assert.ok([400, 401, 404].includes(r.status), `${target}: ${r.status}`);
    assert.doesNotMatch(r.body, /kiln_http_request_duration_seconds|# HELP/, target);
  }
  const wrong = await request(`${k.url}/metrics`, { headers: { authorization: "Bearer kiln_wrong_key_0123456789abcdefghijkl" } });
  assert.equal(wrong.statusCode, 401);
  assert.doesNotMatch(await wrong.body.text(), /# HELP/);
});

test("what a key holder names (paths, methods, ids, names) neither grows the label sets nor reaches the exposition", async () => {
  const marker = `mark${randomBytes(6).toString("hex")}`;
  const hostile = (i: number) => `${marker}-${i}"} 1\n# HELP evil\nkiln_injected{a="`;
  const round = async (r: number) => {
    const calls: Promise<unknown>[] = [];
    for (let i = 0; i < 60; i++) {
      const id = `${marker}${r}x${i}`;
      calls.push(
        k.call("GET", `/v1/machines/mch_${id}`),
        k.call("GET", `/v1/${id}/${encodeURIComponent(hostile(i))}`),
        k.call("POST", "/v1/machines", { body: { name: hostile(i), metadata: { [id]: hostile(i) }, template: `local/${id}` } }),
        k.call("POST", "/v1/volumes", { body: { name: hostile(i) } }),
        k.call("GET", `/sandboxes/${id}`, { headers: { "x-api-key": TEST_KEY } }),
        rawRequest(port, ["PROPFIND", "PURGE", "MKCOL", "LINK", "SEARCH"][i % 5], `/v1/${id}`, { ...auth, host: `${id}.example` }),
      );
    }
    await Promise.all(calls);
    return scrape();
  };
  const first = await round(1);
  const second = await round(2);
  for (const text of [first, second]) {
    assert.ok(!text.includes(marker), "a caller's name reached the exposition");
    for (const line of text.split("\n")) {
      if (!line) continue;
      assert.match(line, /^(# (HELP|TYPE) kiln_[a-z0-9_]+ .*|kiln_[a-z0-9_]+(\{([a-z_]+="[^"\\\n]*",?)*\})? [-+0-9.eInfNa]+)$/, `not an exposition line: ${line}`);
    }
  }
  // Another round of different names and methods made no new series: the labels are route patterns, not paths.
  const name = "kiln_http_request_duration_seconds_count";
  // (The first scrape's own answer is the one series the second scrape may add.)
  assert.deepEqual([...series(second, name)].filter((s) => !series(first, name).has(s) && !s.includes('route="/metrics"')), []);
  assert.ok(series(second, name).size < 100, `${series(second, name).size} request series`);
  assert.ok([...series(second, name)].some((s) => s.includes('route="unmatched"')));
});

async function mcp(body: string | Buffer, headers: Record<string, string> = auth) {
  const res = await request(`${k.url}/v1/mcp`, { method: "POST", headers: { "content-type": "application/json", accept: "application/json, text/event-stream", "mcp-protocol-version": "2025-06-18", ...headers }, body });
  return { status: res.statusCode, text: await res.body.text() };
}
const rpc = (id: number, method: string, params: unknown = {}) => ({ jsonrpc: "2.0", id, method, params });

test("MCP: every method, single or batched, and every other verb on the route needs the key", async () => {
  const init = rpc(1, "initialize", { protocolVersion: "2025-06-18", capabilities: {}, clientInfo: { name: "x", version: "1" } });
  const messages = [init, rpc(2, "tools/list"), rpc(3, "tools/call", { name: "list_machines", arguments: {} }), rpc(4, "ping"), { jsonrpc: "2.0", method: "notifications/initialized" }];
  for (const headers of [{}, { authorization: "Bearer kiln_wrong_key_0123456789abcdefghijkl" }, { "x-api-key": TEST_KEY.slice(0, -1) }] as Record<string, string>[]) {
    for (const m of [...messages, messages]) {
      const r = await mcp(JSON.stringify(m), headers);
      assert.equal(r.status, 401, `${JSON.stringify(m).slice(0, 60)}: ${r.status} ${r.text}`);
      assert.doesNotMatch(r.text, /"result"|list_machines/);
    }
  }
  for (const method of ["GET", "DELETE", "PUT", "PATCH", "OPTIONS"]) {
    const r = await request(`${k.url}/v1/mcp`, { method: method as "GET", headers: { accept: "application/json, text/event-stream" } });
    const text = await r.body.text();
    assert.ok([401, 404, 405].includes(r.statusCode), `${method}: ${r.statusCode} ${text}`);
    assert.doesNotMatch(text, /"result"|tools/);
  }
});

test("MCP: a body past the limit is refused with 413 before it is read; a batch of many calls is answered, bounded, and the server stays up", async () => {
  const big = await mcp(JSON.stringify({ ...rpc(1, "tools/list"), pad: "x".repeat(BODY_LIMIT + 1) }));
  assert.equal(big.status, 413, big.text);
  // A batch is at most 100 messages; 100 tool calls that each fail (unknown machines) get their own errors as tool
  // results, never a protocol failure, none naming the server's files; the server answers /health meanwhile.
  const calls = (n: number) => Array.from({ length: n }, (_, i) => rpc(i + 1, "tools/call", { name: i % 2 ? "read_file" : "run_command", arguments: { machine_id: `mch_nope${i}`, command: "true", path: "/etc/passwd" } }));
  const tooMany = await mcp(JSON.stringify(calls(1500)));
  assert.equal(tooMany.status, 400);
  assert.match(tooMany.text, /exceed 100/);
  const health = request(`${k.url}/health`).then((r) => r.body.text().then(() => r.statusCode));
  const batch = await mcp(JSON.stringify(calls(100)));
  assert.equal(batch.status, 200, batch.text.slice(0, 300));
  const answers = JSON.parse(batch.text) as { id: number; result?: { isError?: boolean; content: { text?: string }[] } }[];
  assert.equal(answers.length, 100);
  for (const a of answers) assert.equal(a.result?.isError, true, JSON.stringify(a));
  assert.match(answers[0].result!.content[0].text!, /mch_nope0/);
  assert.equal(await health, 200);
  assert.ok(!batch.text.includes(k.dataDir) && !batch.text.includes("/src/") && !batch.text.includes("node_modules"), "an error named the server's files");
});
