// Kiln's MCP server driven by the published MCP client (@modelcontextprotocol/sdk): over Streamable HTTP at
// POST /v1/mcp and over stdio (`kiln mcp`), against real machines — tools listed, a full agent session, long output
// cut with a note, a machine port reached through get_port_url, and every failure a tool error with Kiln's message.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { join } from "node:path";
import { spawnSync } from "node:child_process";
import { request } from "undici";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import type { CallToolResult } from "@modelcontextprotocol/sdk/types.js";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

const KILN = join(import.meta.dirname, "..", "..", "bin", "kiln");
const TOOLS = [
  "create_machine",
  "list_machines",
  "destroy_machine",
  "run_command",
  "read_file",
  "write_file",
  "list_files",
  "run_code",
  "get_port_url",
  "snapshot_machine",
  "fork_machine",
  "list_snapshots",
  "delete_snapshot",
];

let k: TestKiln;
let http: Client;
before(async () => {
  k = await startTestKiln();
  http = await httpClient(TEST_KEY);
});
after(async () => {
  await http?.close();
  await k?.close();
});

async function httpClient(key: string): Promise<Client> {
  const client = new Client({ name: "kiln-test", version: "1.0.0" });
  await client.connect(new StreamableHTTPClientTransport(new URL(`${k.url}/v1/mcp`), { requestInit: { headers: { authorization: `Bearer ${key}` } } }));
  return client;
}

async function call(client: Client, name: string, args: Record<string, unknown>): Promise<CallToolResult> {
  return (await client.callTool({ name, arguments: args })) as CallToolResult;
}

function text(r: CallToolResult): string {
  return r.content
    .filter((c) => c.type === "text")
    .map((c) => (c as { text: string }).text)
    .join("\n");
}

/** create → write a file → a command that reads it → code (text and an image) → list, read → destroy. */
async function session(client: Client, language: "python" | "javascript") {
  const created = await call(client, "create_machine", { timeout_s: 600, envs: { GREETING: "hello" } });
  assert.equal(created.isError, undefined, text(created));
  const id = (created.structuredContent as { machine: { id: string } }).machine.id;
  assert.match(id, /^mch_/);
  assert.match(text(created), new RegExp(`Created machine ${id}`));

  const wrote = await call(client, "write_file", { machine_id: id, path: "notes/today.txt", content: "kiln over mcp\n" });
  assert.equal(wrote.isError, undefined, text(wrote));
  assert.match(text(wrote), /Wrote 14 bytes to \/workspace\/notes\/today\.txt/);

  const ran = await call(client, "run_command", { machine_id: id, command: "cat notes/today.txt; echo $GREETING >&2; exit 3" });
  assert.equal(ran.isError, undefined, "a non-zero exit is an answer, not a tool error");
  assert.deepEqual(
    { exit_code: (ran.structuredContent as any).exit_code, stdout: (ran.structuredContent as any).stdout, stderr: (ran.structuredContent as any).stderr },
    { exit_code: 3, stdout: "kiln over mcp\n", stderr: "hello\n" },
  );
  assert.match(text(ran), /^exit code 3 /);

  const listed = await call(client, "list_files", { machine_id: id, path: "/workspace", depth: 2 });
  assert.match(text(listed), /-\s+0644\s+user\s+14\s+\/workspace\/notes\/today\.txt/);

  const read = await call(client, "read_file", { machine_id: id, path: "/workspace/notes/today.txt" });
  assert.equal(text(read), "kiln over mcp\n");

  if (language === "python") {
    const first = await call(client, "run_code", { machine_id: id, code: "x = open('/workspace/notes/today.txt').read().strip()\nprint(x.upper())" });
    assert.equal(text(first), "KILN OVER MCP");
    // State persists between calls; an image result comes back as MCP image content with the exact bytes.
    const png = Buffer.from("89504e470d0a1a0a0000000d49484452000000010000000108020000009077533de00000000c4944415478da63f8cfc000000301010018dd8db00000000049454e44ae426082", "hex");
    const second = await call(client, "run_code", { machine_id: id, code: `from IPython.display import Image\nprint(len(x))\nImage(data=bytes.fromhex('${png.toString("hex")}'))` });
    assert.equal(second.isError, undefined, text(second));
    assert.equal(text(second), "13");
    const image = second.content.find((c) => c.type === "image") as { data: string; mimeType: string } | undefined;
    assert.equal(image?.mimeType, "image/png");
    assert.ok(Buffer.from(image!.data, "base64").equals(png));
    const raised = await call(client, "run_code", { machine_id: id, code: "1/0" });
    assert.match(text(raised), /ZeroDivisionError/);
  } else {
    await call(client, "run_code", { machine_id: id, language: "javascript", code: "const fs = require('fs'); let n = fs.readFileSync('/workspace/notes/today.txt', 'utf8').length" });
    const second = await call(client, "run_code", { machine_id: id, language: "javascript", code: "console.log('chars', n); n * 2" });
    assert.equal(text(second), "chars 14\n28");
  }

  const gone = await call(client, "destroy_machine", { machine_id: id });
  assert.equal(gone.isError, undefined, text(gone));
  assert.equal((await k.call("GET", `/v1/machines/${id}`)).body.status, "destroyed");
}

test("over Streamable HTTP, POST /v1/mcp lists every tool with a description and a JSON schema", async () => {
  const { tools } = await http.listTools();
  assert.deepEqual(tools.map((t) => t.name).sort(), [...TOOLS].sort());
  for (const t of tools) {
    assert.ok((t.description ?? "").length > 40, `${t.name} is described`);
    assert.equal(t.inputSchema.type, "object");
  }
  const run = tools.find((t) => t.name === "run_command")!;
  assert.deepEqual([...(run.inputSchema.required ?? [])].sort(), ["command", "machine_id"]);
  assert.equal(http.getServerVersion()?.name, "kiln");
});

test("over Streamable HTTP: a full session (create, write, run a command that reads it, run code, destroy)", async () => {
  await session(http, "python");
});

test("over stdio, `kiln mcp` serves the same tools and a full session against KILN_URL with KILN_API_KEY", async () => {
  const client = new Client({ name: "kiln-test-stdio", version: "1.0.0" });
  const transport = new StdioClientTransport({ command: KILN, args: ["mcp"], env: { PATH: process.env.PATH ?? "", KILN_URL: k.url, KILN_API_KEY: TEST_KEY }, stderr: "pipe" });
  await client.connect(transport);
  try {
    assert.deepEqual((await client.listTools()).tools.map((t) => t.name).sort(), [...TOOLS].sort());
    await session(client, "javascript");
  } finally {
    await client.close();
  }
});

test("a quick answer is one JSON body; a slower one streams as SSE from the first second on", async () => {
  const created = await call(http, "create_machine", {});
  const id = (created.structuredContent as { machine: { id: string } }).machine.id;
  const post = async (command: string) => {
    const res = await request(`${k.url}/v1/mcp`, {
      method: "POST",
      headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json", accept: "application/json, text/event-stream", "mcp-protocol-version": "2025-06-18" },
      body: JSON.stringify({ jsonrpc: "2.0", id: 7, method: "tools/call", params: { name: "run_command", arguments: { machine_id: id, command } } }),
    });
    return { status: res.statusCode, type: String(res.headers["content-type"]), text: await res.body.text() };
  };
  try {
    const quick = await post("echo quick");
    assert.equal(quick.status, 200);
    assert.match(quick.type, /^application\/json/);
    const answer = JSON.parse(quick.text) as { id: number; result: { structuredContent: { stdout: string } } };
    assert.equal(answer.id, 7);
    assert.equal(answer.result.structuredContent.stdout, "quick\n");

    const slow = await post("sleep 1.5; echo slow");
    assert.equal(slow.status, 200);
    assert.match(slow.type, /^text\/event-stream/);
    const data = slow.text.split("\n").filter((l) => l.startsWith("data: ")).map((l) => JSON.parse(l.slice(6)));
    assert.equal(data.length, 1, slow.text);
    assert.equal(data[0].id, 7);
    assert.equal(data[0].result.structuredContent.stdout, "slow\n");
    // The SDK's client takes either.
    const viaClient = await call(http, "run_command", { machine_id: id, command: "sleep 1.2; echo client" });
    assert.equal((viaClient.structuredContent as { stdout: string }).stdout, "client\n");

    // A batch answers every request in it, quick or slow.
    const batch = (slow: boolean) =>
      request(`${k.url}/v1/mcp`, {
        method: "POST",
        headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json", accept: "application/json, text/event-stream", "mcp-protocol-version": "2025-06-18" },
        body: JSON.stringify([
          { jsonrpc: "2.0", id: 1, method: "tools/call", params: { name: "run_command", arguments: { machine_id: id, command: slow ? "sleep 1.2; echo one" : "echo one" } } },
          { jsonrpc: "2.0", id: 2, method: "tools/call", params: { name: "run_command", arguments: { machine_id: id, command: "echo two" } } },
        ]),
      });
    const quickBatch = await batch(false);
    assert.match(String(quickBatch.headers["content-type"]), /^application\/json/);
    const quickAnswers = (await quickBatch.body.json()) as { id: number; result: { structuredContent: { stdout: string } } }[];
    assert.deepEqual(quickAnswers.map((a) => [a.id, a.result.structuredContent.stdout]).sort(), [[1, "one\n"], [2, "two\n"]]);
    const slowBatch = await batch(true);
    assert.match(String(slowBatch.headers["content-type"]), /^text\/event-stream/);
    const events = (await slowBatch.body.text()).split("\n").filter((l) => l.startsWith("data: ")).map((l) => JSON.parse(l.slice(6)));
    assert.deepEqual(events.map((a) => [a.id, a.result.structuredContent.stdout]).sort(), [[1, "one\n"], [2, "two\n"]]);

    // A client that goes away during a slow call: the server goes on answering others.
    const ctl = new AbortController();
    const abandoned = request(`${k.url}/v1/mcp`, {
      method: "POST",
      signal: ctl.signal,
      headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json", accept: "application/json, text/event-stream", "mcp-protocol-version": "2025-06-18" },
      body: JSON.stringify({ jsonrpc: "2.0", id: 9, method: "tools/call", params: { name: "run_command", arguments: { machine_id: id, command: "sleep 2; echo late > /tmp/late" } } }),
    });
    const headers = await abandoned;
    assert.match(String(headers.headers["content-type"]), /^text\/event-stream/);
    ctl.abort();
    await headers.body.text().catch(() => undefined);
    assert.equal(JSON.parse((await post("echo still")).text).result.structuredContent.stdout, "still\n");
    // Once the abandoned command has ended (its answer going to no one), the server still answers.
    const after = await post("for i in $(seq 100); do [ -f /tmp/late ] && break; sleep 0.1; done; cat /tmp/late");
    const message = after.type.startsWith("text/event-stream") ? after.text.split("\n").find((l) => l.startsWith("data: "))!.slice(6) : after.text;
    assert.equal(JSON.parse(message).result.structuredContent.stdout, "late\n");
  } finally {
    await call(http, "destroy_machine", { machine_id: id });
  }
});

test("a wrong key is refused: 401 with Kiln's envelope, and the MCP client cannot connect", async () => {
  const res = await request(`${k.url}/v1/mcp`, {
    method: "POST",
    headers: { authorization: "Bearer kiln_wrong_0000000000000000000000000000", "content-type": "application/json", accept: "application/json, text/event-stream" },
    body: JSON.stringify({ jsonrpc: "2.0", id: 1, method: "tools/list" }),
  });
  assert.equal(res.statusCode, 401);
  const body = (await res.body.json()) as { code: string; request_id: string };
  assert.equal(body.code, "unauthorized");
  assert.match(body.request_id, /^req_/);
  await assert.rejects(httpClient("kiln_wrong_0000000000000000000000000000"));
});

test("Kiln's errors come back as tool errors with its code and message, never as protocol failures", async () => {
  const unknown = await call(http, "run_command", { machine_id: "mch_00000000000000000000000000", command: "true" });
  assert.equal(unknown.isError, true);
  assert.match(text(unknown), /^not_found: .+\(request req_/);
  const invalid = await call(http, "create_machine", { vcpus: 100000 });
  assert.equal(invalid.isError, true);
  assert.match(text(invalid), /^invalid_request: /);
  // Arguments the tool's schema refuses, and an id that tries to walk to another route.
  const badArgs = await call(http, "run_command", { machine_id: "mch_1" });
  assert.equal(badArgs.isError, true);
  const walk = await call(http, "destroy_machine", { machine_id: "../keys" });
  assert.equal(walk.isError, true);
  assert.equal((await k.call("GET", "/v1/keys")).status, 200, "the keys are still there");
});

test("over Streamable HTTP: snapshot and fork (create, write, snapshot, fork, the child has the file, a machine from the snapshot too, destroy all)", async () => {
  const created = await call(http, "create_machine", { timeout_s: 600 });
  assert.equal(created.isError, undefined, text(created));
  const parent = (created.structuredContent as { machine: { id: string } }).machine.id;
  const made = [parent];
  let snapshotId: string | undefined;
  try {
    await call(http, "write_file", { machine_id: parent, path: "state/plan.txt", content: "before the fork\n" });

    const snap = await call(http, "snapshot_machine", { machine_id: parent, name: "mcp-before" });
    assert.equal(snap.isError, undefined, text(snap));
    const snapshot = (snap.structuredContent as { snapshot: { id: string; status: string; machine_id: string; name: string } }).snapshot;
    snapshotId = snapshot.id;
    assert.match(snapshot.id, /^snp_/);
    assert.deepEqual({ status: snapshot.status, machine_id: snapshot.machine_id, name: snapshot.name }, { status: "ready", machine_id: parent, name: "mcp-before" });
    assert.match(text(snap), new RegExp(`Took snapshot ${snapshot.id} of ${parent}`));

    const listed = await call(http, "list_snapshots", { machine_id: parent });
    assert.equal(listed.isError, undefined, text(listed));
    assert.deepEqual(
      (listed.structuredContent as { snapshots: { id: string }[] }).snapshots.map((s) => s.id),
      [snapshot.id],
    );

    // The parent changes after the snapshot; the fork sees the later state, the snapshot's machine the earlier one.
    await call(http, "write_file", { machine_id: parent, path: "state/plan.txt", content: "after the snapshot\n" });
    const forked = await call(http, "fork_machine", { machine_id: parent, count: 2, timeout_s: 600 });
    assert.equal(forked.isError, undefined, text(forked));
    const children = (forked.structuredContent as { machines: { id: string; status: string }[] }).machines;
    made.push(...children.map((c) => c.id));
    assert.equal(children.length, 2);
    assert.ok(children.every((c) => c.id !== parent && c.status === "running"), JSON.stringify(children));
    assert.match(text(forked), /^Forked mch_\w+ into 2 machines: mch_/);
    for (const child of children) {
      const ran = await call(http, "run_command", { machine_id: child.id, command: "cat state/plan.txt" });
      assert.equal((ran.structuredContent as { stdout: string }).stdout, "after the snapshot\n");
    }
    // A child is its own machine: what it writes, the parent does not see.
    await call(http, "write_file", { machine_id: children[0]!.id, path: "state/plan.txt", content: "child's own\n" });
    assert.equal(text(await call(http, "read_file", { machine_id: parent, path: "state/plan.txt" })), "after the snapshot\n");

    const fromSnap = await call(http, "create_machine", { snapshot: snapshot.id, timeout_s: 600 });
    assert.equal(fromSnap.isError, undefined, text(fromSnap));
    const restored = (fromSnap.structuredContent as { machine: { id: string } }).machine.id;
    made.push(restored);
    assert.equal(text(await call(http, "read_file", { machine_id: restored, path: "/workspace/state/plan.txt" })), "before the fork\n");

    // Errors are tool errors with Kiln's message: memory on runc (or a bad count), an unknown snapshot.
    const tooMany = await call(http, "fork_machine", { machine_id: parent, count: 33 });
    assert.equal(tooMany.isError, true);
    const unknownFork = await call(http, "fork_machine", { machine_id: "mch_00000000000000000000000000" });
    assert.equal(unknownFork.isError, true);
    assert.match(text(unknownFork), /^not_found: /);

    const deleted = await call(http, "delete_snapshot", { snapshot_id: snapshot.id });
    assert.equal(deleted.isError, undefined, text(deleted));
    assert.equal((await k.call("GET", `/v1/snapshots/${snapshot.id}`)).body.status, "deleted");
    snapshotId = undefined;
    const gone = await call(http, "list_snapshots", { machine_id: parent });
    assert.match(text(gone), /^No snapshots\./);
    const unknownSnap = await call(http, "create_machine", { snapshot: snapshot.id });
    assert.equal(unknownSnap.isError, true, text(unknownSnap));
  } finally {
    if (snapshotId) await call(http, "delete_snapshot", { snapshot_id: snapshotId });
    for (const id of made) {
      const gone = await call(http, "destroy_machine", { machine_id: id });
      assert.equal(gone.isError, undefined, text(gone));
    }
  }
  for (const id of made) assert.equal((await k.call("GET", `/v1/machines/${id}`)).body.status, "destroyed");
});

test("long output is cut (start and end kept) with a note that says how to read the rest", async () => {
  const created = await call(http, "create_machine", {});
  const id = (created.structuredContent as { machine: { id: string } }).machine.id;
  try {
    const ran = await call(http, "run_command", { machine_id: id, command: "echo FIRST; head -c 100000 /dev/zero | tr '\\0' x; echo; echo LAST" });
    const out = (ran.structuredContent as { stdout: string; truncated: boolean }).stdout;
    assert.equal((ran.structuredContent as { truncated: boolean }).truncated, true);
    assert.ok(out.length < 17_000, `cut to about 16000 characters, got ${out.length}`);
    assert.match(out, /^FIRST\n/);
    assert.match(out, /LAST\n$/);
    assert.match(out, /characters cut: redirect the output to a file/);
    // A file longer than read_file's bound: its start, and the note.
    await call(http, "run_command", { machine_id: id, command: "head -c 300000 /dev/zero | tr '\\0' y > big.txt" });
    const read = await call(http, "read_file", { machine_id: id, path: "big.txt" });
    assert.match(text(read), /^y+/);
    assert.match(text(read), /longer than 262144 bytes/);
  } finally {
    await call(http, "destroy_machine", { machine_id: id });
  }
});

test("get_port_url gives a URL and header that reach a server listening in the machine", async () => {
  const created = await call(http, "create_machine", {});
  const id = (created.structuredContent as { machine: { id: string } }).machine.id;
  try {
    await call(http, "write_file", { machine_id: id, path: "/workspace/site/index.html", content: "served from the machine\n" });
    await call(http, "run_command", { machine_id: id, command: "cd /workspace/site && nohup python3 -m http.server 8000 >/tmp/http.log 2>&1 &" });
    const got = await call(http, "get_port_url", { machine_id: id, port: 8000 });
    assert.equal(got.isError, undefined, text(got));
    const { host, headers, kiln_url } = got.structuredContent as { host: string; headers: Record<string, string>; kiln_url: string };
    assert.match(host, new RegExp(`^8000-${id}\\.`));
    // Poll until the server in the machine listens (python's start time), bounded.
    let body = "";
    for (let i = 0; i < 50 && body !== "served from the machine\n"; i++) {
      const res = await request(`${kiln_url}/index.html`, { headers: { host, ...headers } });
      body = await res.body.text();
      if (res.statusCode !== 200) await new Promise((r) => setTimeout(r, 200));
    }
    assert.equal(body, "served from the machine\n");
    const without = await request(`${kiln_url}/index.html`, { headers: { host } });
    assert.equal(without.statusCode, 401);
    await without.body.dump();
  } finally {
    await call(http, "destroy_machine", { machine_id: id });
  }
});

test("envs given through the MCP tools reach the machine but neither the logs nor the data dir", async () => {
  const marker = `mcp_marker_${Date.now().toString(36)}_${Math.random().toString(36).slice(2)}`;
  const created = await call(http, "create_machine", { envs: { MACHINE_SECRET: `${marker}_machine` } });
  const id = (created.structuredContent as { machine: { id: string } }).machine.id;
  try {
    const ran = await call(http, "run_command", { machine_id: id, command: "echo $MACHINE_SECRET $RUN_SECRET | wc -c", envs: { RUN_SECRET: `${marker}_run` } });
    assert.equal((ran.structuredContent as { stdout: string }).stdout.trim(), String(`${marker}_machine ${marker}_run\n`.length), "both reached the command");
    assert.ok(!k.logs.some((l) => l.includes(marker)), "no log line carries the marker");
    const found = spawnSync("grep", ["-rlaF", "-D", "skip", "--exclude-dir=rootfs", "--exclude=disk.img", "--exclude=image.ext4", "--exclude=disks.xfs", "--exclude-dir=disks", "-e", marker, k.dataDir]);
    assert.equal(found.stdout.toString(), "", "the marker is nowhere in the data dir");
  } finally {
    await call(http, "destroy_machine", { machine_id: id });
  }
});

test("an operator-only action through a tool is a tool error for another key, and nothing is made; the operator's key may do it", async () => {
  const made = await k.call("POST", "/v1/keys", { body: { name: "mcp-not-operator" } });
  assert.equal(made.status, 201, made.text);
  const other = await httpClient(made.body.key);
  try {
    const before = (await k.call("GET", "/v1/machines")).body.machines.length;
    // Opening a private range for a machine's egress takes the operator's key (the create route decides).
    const refused = await call(other, "create_machine", { allow_out: ["10.0.0.0/8"] });
    assert.equal(refused.isError, true, text(refused));
    assert.match(text(refused), /^forbidden: .*operator's key.*\(request req_/);
    assert.equal((await k.call("GET", "/v1/machines")).body.machines.length, before, "no machine was made");
    // run_command (served without re-entering the API) still holds its arguments to the exec route's schema.
    const unknown = await call(other, "run_command", { machine_id: "mch_00000000000000000000000000", command: "true", cwd: "/tmp\u0000x" });
    assert.equal(unknown.isError, true);
    assert.match(text(unknown), /^invalid_request: body\/cwd /);
    // TEST_KEY is the server's KILN_API_KEY: the operator's.
    const opened = await call(http, "create_machine", { allow_out: ["10.0.0.0/8"] });
    assert.equal(opened.isError, undefined, text(opened));
    const machine = (opened.structuredContent as { machine: { id: string } }).machine;
    assert.equal((await call(http, "destroy_machine", { machine_id: machine.id })).isError, undefined);
  } finally {
    await other.close();
    await k.call("DELETE", `/v1/keys/${made.body.id}`);
  }
});

test("each POST's tools act with that POST's key: after a key is revoked, calls of another key on the servers it used all succeed, and its own are refused", async () => {
  const made = await k.call("POST", "/v1/keys", { body: { name: "mcp-first" } });
  assert.equal(made.status, 201, made.text);
  const second = await k.call("POST", "/v1/keys", { body: { name: "mcp-second" } });
  const first = await httpClient(made.body.key);
  const other = await httpClient(second.body.key);
  try {
    // Concurrent calls of the first key: every server they held goes back for reuse.
    const listed = await Promise.all(Array.from({ length: 12 }, () => call(first, "list_machines", {})));
    for (const r of listed) assert.equal(r.isError, undefined, text(r));
    assert.equal((await k.call("DELETE", `/v1/keys/${made.body.id}`)).status, 200);
    // The other key's calls run on those servers: a tool still holding the revoked key would answer unauthorized.
    const after = await Promise.all(Array.from({ length: 12 }, () => call(other, "list_machines", {})));
    for (const r of after) assert.equal(r.isError, undefined, text(r));
    await assert.rejects(call(first, "list_machines", {}), /401|unauthorized/i);
  } finally {
    await first.close().catch(() => undefined);
    await other.close();
    await k.call("DELETE", `/v1/keys/${second.body.id}`);
  }
});
