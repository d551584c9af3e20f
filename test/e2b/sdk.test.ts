// The published `e2b` SDK, unchanged, against a real Kiln: E2B_API_URL and the sandbox URL are both Kiln's base
// URL and the key is one Kiln issued in E2B's shape. Each test asserts what E2B's documentation says a call returns.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readdir, readFile } from "node:fs/promises";
import { join } from "node:path";
import { request } from "undici";
import { Sandbox, CommandExitError, SandboxNotFoundError, AuthenticationError, NotFoundError } from "e2b";
import type { SandboxOpts } from "e2b";
import { filesWithContents } from "../support/files.ts";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";

let k: TestKiln;
let key: string;
let opts: SandboxOpts;
let sbx: Sandbox;

before(async () => {
  k = await startTestKiln();
  key = (await k.kiln.services.keys.create("e2b-sdk", generateKeyIn("e2b"))).key;
  // The SDK's defaults otherwise: its key check (^e2b_[0-9a-f]+$) stays on; plain http to Kiln for both planes.
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 30_000 };
  // Longer than E2B's 15 s default: on a loaded host the suite takes longer than that to reach its last tests.
  sbx = await Sandbox.create("base", { ...opts, metadata: { suite: "e2b-sdk" }, timeoutMs: 600_000 });
});
after(async () => k?.close());

test("kiln issues keys in the shape the E2B SDK checks", () => {
  assert.match(key, /^e2b_[0-9a-f]+$/);
});

test("Sandbox.create returns a sandbox with an id, and getInfo describes it as running", async () => {
  // Hostname-safe, as E2B's: lowercase letters and digits, the machine id's body (1:1 with Kiln's `mch_` id).
  assert.match(sbx.sandboxId, /^[0-9a-z]{26}$/);
  assert.equal((await k.call("GET", `/v1/machines/mch_${sbx.sandboxId}`)).status, 200);
  const info = await Sandbox.getInfo(sbx.sandboxId, opts);
  assert.equal(info.sandboxId, sbx.sandboxId);
  assert.equal(info.state, "running");
  assert.deepEqual(info.metadata, { suite: "e2b-sdk" });
  assert.ok(info.startedAt instanceof Date && !Number.isNaN(info.startedAt.getTime()));
  assert.ok(info.endAt.getTime() > Date.now());
  assert.equal(await sbx.isRunning(), true);
});

test("commands.run in the foreground returns stdout, stderr and the exit code", async () => {
  const r = await sbx.commands.run("echo hello; echo oops >&2; whoami; pwd");
  assert.equal(r.exitCode, 0);
  assert.equal(r.stdout, "hello\nuser\n/home/user\n");
  assert.equal(r.stderr, "oops\n");
  const envs = await sbx.commands.run("echo $GREETING", { envs: { GREETING: "hi" }, cwd: "/tmp", user: "root" });
  assert.equal(envs.stdout, "hi\n");
  const where = await sbx.commands.run("pwd; whoami", { cwd: "/tmp", user: "root" });
  assert.equal(where.stdout, "/tmp\nroot\n");
});

test("a command that exits non-zero rejects with CommandExitError carrying its exit code", async () => {
  await assert.rejects(sbx.commands.run("echo partial; exit 3"), (err: unknown) => {
    assert.ok(err instanceof CommandExitError);
    assert.equal(err.exitCode, 3);
    assert.equal(err.stdout, "partial\n");
    return true;
  });
});

test("a background command takes stdin, is listed, and wait() gives its result", async () => {
  const handle = await sbx.commands.run("cat", { background: true, stdin: true });
  assert.ok(handle.pid > 0);
  const listed = await sbx.commands.list();
  assert.ok(listed.some((p) => p.pid === handle.pid && p.cmd === "/bin/bash" && p.args.includes("cat")));
  await sbx.commands.sendStdin(handle.pid, "line one\n");
  await handle.closeStdin();
  const result = await handle.wait();
  assert.equal(result.exitCode, 0);
  assert.equal(result.stdout, "line one\n");
});

test("a background command outlives its handle, can be re-attached with connect, and kill ends it", async () => {
  const handle = await sbx.commands.run("echo started; sleep 600", { background: true });
  await handle.disconnect();
  const again = await sbx.commands.connect(handle.pid);
  assert.equal(again.pid, handle.pid);
  assert.equal(await sbx.commands.kill(handle.pid), true);
  await assert.rejects(again.wait(), (err: unknown) => err instanceof CommandExitError);
  assert.ok(!(await sbx.commands.list()).some((p) => p.pid === handle.pid));
  assert.equal(await sbx.commands.kill(handle.pid), false);
});

test("files.write and files.read carry text and bytes, relative paths from the user's home", async () => {
  const info = await sbx.files.write("notes/hello.txt", "hello from e2b\n");
  assert.equal(info.path, "/home/user/notes/hello.txt");
  assert.equal(await sbx.files.read("/home/user/notes/hello.txt"), "hello from e2b\n");
  const bytes = new Uint8Array(256).map((_, i) => i);
  await sbx.files.write("/tmp/bytes.bin", bytes.buffer);
  assert.deepEqual(await sbx.files.read("/tmp/bytes.bin", { format: "bytes" }), bytes);
  const big = Buffer.alloc(3 * 1024 * 1024, "k");
  await sbx.files.write("/tmp/big.txt", new Blob([big]));
  assert.equal((await sbx.files.read("/tmp/big.txt")).length, big.length);
  const r = await sbx.commands.run("cat notes/hello.txt; stat -c %U notes/hello.txt");
  assert.equal(r.stdout, "hello from e2b\nuser\n");
});

test("writeFiles sends several files in one multipart upload; gzip uploads arrive decompressed", async () => {
  const written = await sbx.files.write([
    { path: "/tmp/multi/a.txt", data: "A" },
    { path: "/tmp/multi/b.txt", data: "B" },
  ]);
  assert.deepEqual(written.map((w) => w.path).sort(), ["/tmp/multi/a.txt", "/tmp/multi/b.txt"]);
  assert.equal((await sbx.commands.run("cat /tmp/multi/a.txt /tmp/multi/b.txt")).stdout, "AB");
  await sbx.files.write("/tmp/zipped.txt", "compressed on the wire\n", { gzip: true });
  assert.equal(await sbx.files.read("/tmp/zipped.txt"), "compressed on the wire\n");
});

test("a command's output streams through onStdout in order, however long", async () => {
  const chunks: string[] = [];
  const r = await sbx.commands.run("seq 1 100000", { onStdout: (d) => void chunks.push(d) });
  const expected = Array.from({ length: 100000 }, (_, i) => `${i + 1}\n`).join("");
  assert.equal(r.stdout, expected);
  assert.equal(chunks.join(""), expected);
  assert.ok(chunks.length > 1);
});

test("files.list, exists, getInfo, makeDir, rename and remove", async () => {
  assert.equal(await sbx.files.makeDir("/tmp/tree/a"), true);
  assert.equal(await sbx.files.makeDir("/tmp/tree/a"), false);
  await sbx.files.write("/tmp/tree/a/one.txt", "1");
  await sbx.files.write("/tmp/tree/top.txt", "top");
  const shallow = await sbx.files.list("/tmp/tree");
  assert.deepEqual(shallow.map((e) => `${e.name}:${e.type}`).sort(), ["a:dir", "top.txt:file"]);
  const deep = await sbx.files.list("/tmp/tree", { depth: 2 });
  assert.ok(deep.some((e) => e.path === "/tmp/tree/a/one.txt" && e.type === "file"));
  assert.equal(await sbx.files.exists("/tmp/tree/top.txt"), true);
  assert.equal(await sbx.files.exists("/tmp/tree/nope"), false);
  const info = await sbx.files.getInfo("/tmp/tree/top.txt");
  assert.equal(info.size, 3);
  assert.equal(info.type, "file");
  const moved = await sbx.files.rename("/tmp/tree/top.txt", "/tmp/tree/moved.txt");
  assert.equal(moved.path, "/tmp/tree/moved.txt");
  assert.equal(await sbx.files.exists("/tmp/tree/top.txt"), false);
  await sbx.files.remove("/tmp/tree");
  assert.equal(await sbx.files.exists("/tmp/tree"), false);
  await assert.rejects(sbx.files.read("/tmp/tree/moved.txt"), (err: unknown) => err instanceof NotFoundError);
});

test("a PTY takes input, reports output and can be resized", async () => {
  let out = "";
  const decoder = new TextDecoder();
  const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => void (out += decoder.decode(d)) });
  await sbx.pty.resize(pty.pid, { cols: 120, rows: 40 });
  await sbx.pty.sendInput(pty.pid, new TextEncoder().encode("stty size; exit\n"));
  const result = await pty.wait();
  assert.equal(result.exitCode, 0);
  assert.match(out, /40 120/);
});

test("Sandbox.list pages through sandboxes filtered by metadata and state", async () => {
  const other = await Sandbox.create("base", { ...opts, metadata: { suite: "other" } });
  try {
    const page = await Sandbox.list({ ...opts, query: { metadata: { suite: "e2b-sdk" }, state: ["running"] } }).nextItems();
    assert.deepEqual(page.map((s) => s.sandboxId), [sbx.sandboxId]);
    const paginator = Sandbox.list({ ...opts, limit: 1 });
    const first = await paginator.nextItems();
    assert.equal(first.length, 1);
    assert.equal(paginator.hasNext, true);
    const second = await paginator.nextItems();
    assert.notEqual(second[0]?.sandboxId, first[0].sandboxId);
    assert.deepEqual(await Sandbox.list({ ...opts, query: { startedAfter: new Date(Date.now() + 60_000) } }).nextItems(), []);
    const templateId = (await sbx.getInfo()).templateId;
    const byTemplate = await Sandbox.list({ ...opts, query: { template: templateId, metadata: { suite: "other" } } }).nextItems();
    assert.deepEqual(byTemplate.map((s) => s.sandboxId), [other.sandboxId]);
    assert.deepEqual(await Sandbox.list({ ...opts, query: { template: "tpl_none" } }).nextItems(), []);
  } finally {
    await other.kill();
  }
});

test("setTimeout moves the sandbox's end", async () => {
  await sbx.setTimeout(600_000);
  const info = await sbx.getInfo();
  assert.ok(info.endAt.getTime() > Date.now() + 500_000);
});

test("pause then connect resumes the sandbox; pausing a paused sandbox answers false (409)", async () => {
  const s = await Sandbox.create("base", opts);
  await s.files.write("/tmp/kept.txt", "kept");
  assert.equal(await s.pause(), true);
  const paused = await Sandbox.getInfo(s.sandboxId, opts);
  assert.equal(paused.state, "paused");
  // Kept like E2B keeps paused sandboxes: well past the create's timeout.
  assert.ok(paused.endAt.getTime() > Date.now() + 24 * 3600_000);
  assert.equal(await Sandbox.pause(s.sandboxId, opts), false);
  const back = await Sandbox.connect(s.sandboxId, { ...opts, timeoutMs: 120_000 });
  const resumed = await back.getInfo();
  assert.equal(resumed.state, "running");
  assert.ok(resumed.endAt.getTime() < Date.now() + 130_000);
  assert.equal(await back.files.read("/tmp/kept.txt"), "kept");
  assert.equal((await back.commands.run("echo resumed")).stdout, "resumed\n");
  await back.kill();
});

test("kill removes the sandbox; an unknown sandbox is SandboxNotFoundError", async () => {
  const s = await Sandbox.create("base", opts);
  assert.equal(await Sandbox.kill(s.sandboxId, opts), true);
  await assert.rejects(Sandbox.getInfo(s.sandboxId, opts), (err: unknown) => err instanceof SandboxNotFoundError);
  assert.equal(await Sandbox.kill(s.sandboxId, opts), false);
  await assert.rejects(Sandbox.connect("00000000000000000000000000", opts), (err: unknown) => err instanceof SandboxNotFoundError);
});

test("a wrong API key is refused with AuthenticationError", async () => {
  await assert.rejects(Sandbox.create("base", { ...opts, apiKey: "e2b_0123456789abcdef0123456789abcdef01234567" }), (err: unknown) => err instanceof AuthenticationError);
  await assert.rejects(Sandbox.list({ ...opts, apiKey: "e2b_00" }).nextItems(), (err: unknown) => err instanceof AuthenticationError);
});

test("envd refuses a request without the sandbox's access token, and Kiln's /health is unaffected", async () => {
  const headers = { "e2b-sandbox-id": sbx.sandboxId, "content-type": "application/json" };
  const noToken = await request(`${k.url}/process.Process/List`, { method: "POST", headers, body: "{}" });
  assert.equal(noToken.statusCode, 401);
  assert.equal(((await noToken.body.json()) as { code: string }).code, "unauthenticated");
  const wrong = await request(`${k.url}/filesystem.Filesystem/Stat`, { method: "POST", headers: { ...headers, "x-access-token": "not-it" }, body: '{"path":"/"}' });
  assert.equal(wrong.statusCode, 401);
  await wrong.body.dump();
  const kilnHealth = await request(`${k.url}/health`);
  assert.equal(kilnHealth.statusCode, 200);
  await kilnHealth.body.dump();
  const token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
  const envdHealth = await request(`${k.url}/health`, { headers: { "e2b-sandbox-id": sbx.sandboxId, "x-access-token": token } });
  assert.equal(envdHealth.statusCode, 204);
  await envdHealth.body.dump();
  // envd routes the SDK never calls answer 501 in envd's shape, not as an unknown path.
  const envs = await request(`${k.url}/envs`, { headers: { "e2b-sandbox-id": sbx.sandboxId, "x-access-token": token } });
  assert.equal(envs.statusCode, 501);
  assert.match(((await envs.body.json()) as { message: string }).message, /not served by Kiln/);
  // The same sandbox by Host name, as sandbox.getHost(49983) names it.
  const byHost = await request(`${k.url}/filesystem.Filesystem/Stat`, { method: "POST", headers: { host: `49983-${sbx.sandboxId}.kiln.test`, "content-type": "application/json", "x-access-token": token }, body: '{"path":"/home/user"}' });
  assert.equal(byHost.statusCode, 200);
  assert.equal(((await byHost.body.json()) as { entry: { type: string } }).entry.type, "FILE_TYPE_DIRECTORY");
});

test("no API key or access token reaches the data dir or the logs", async () => {
  const token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
  assert.ok(token);
  const all = k.logs.join("");
  assert.ok(!all.includes(key) && !all.includes(token));
  for await (const { path, text } of filesWithContents(k.dataDir)) assert.ok(!text.includes(key) && !text.includes(token), `${path} holds a secret`);
});

test("bad envd requests get Connect errors (unary: HTTP status + JSON; streams: the end frame) and the server goes on", async () => {
  const token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
  const headers = { "e2b-sandbox-id": sbx.sandboxId, "x-access-token": token };
  const unary = async (method: string, body: string) => {
    const res = await request(`${k.url}/${method}`, { method: "POST", headers: { ...headers, "content-type": "application/json" }, body });
    return { status: res.statusCode, body: (await res.body.json()) as { code: string; message: string } };
  };
  assert.deepEqual((await unary("process.Process/SendInput", "{")).status, 400);
  const unknownPid = await unary("process.Process/SendInput", '{"process":{"pid":999999},"input":{"stdin":"aGk="}}');
  assert.equal(unknownPid.status, 404);
  assert.equal(unknownPid.body.code, "not_found");
  assert.equal((await unary("process.Process/SendSignal", '{"process":{"pid":1},"signal":"SIGNAL_SIGHUP"}')).body.code, "invalid_argument");
  assert.equal((await unary("filesystem.Filesystem/Stat", '{"path":42}')).body.code, "invalid_argument");
  const stream = async (body: Buffer) => {
    const res = await request(`${k.url}/process.Process/Start`, { method: "POST", headers: { ...headers, "content-type": "application/connect+json" }, body });
    const bytes = Buffer.from(await res.body.arrayBuffer());
    return { status: res.statusCode, flags: bytes[0], end: JSON.parse(bytes.subarray(5).toString()) as { error?: { code: string } } };
  };
  const garbage = await stream(Buffer.from("not an envelope"));
  assert.equal(garbage.status, 200);
  assert.equal(garbage.flags, 0x02);
  assert.equal(garbage.end.error?.code, "invalid_argument");
  const json = Buffer.from('{"process":{"args":["x"]}}');
  const head = Buffer.alloc(5);
  head.writeUInt32BE(json.length, 1);
  assert.equal((await stream(Buffer.concat([head, json]))).end.error?.code, "invalid_argument");
  assert.equal((await sbx.commands.run("echo still fine")).stdout, "still fine\n");
});

test("the README's three variables are all the SDK needs", async () => {
  const saved = { ...process.env };
  Object.assign(process.env, { E2B_API_KEY: key, E2B_API_URL: k.url, E2B_SANDBOX_URL: k.url });
  try {
    const s = await Sandbox.create();
    assert.equal((await s.commands.run("echo hello from $(whoami)")).stdout, "hello from user\n");
    await s.files.write("notes.txt", "kept");
    assert.equal(await s.files.read("notes.txt"), "kept");
    await s.kill();
  } finally {
    for (const name of ["E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL"]) if (saved[name] === undefined) delete process.env[name];
  }
});

test("getHost(port) reaches a server in the sandbox through Kiln, with the SDK's traffic token", async () => {
  // The SDK fills sbx.trafficAccessToken from Kiln's answer, as from E2B's: that is the token getHost traffic needs.
  const token = sbx.trafficAccessToken!;
  assert.ok(token, "sbx.trafficAccessToken is set");
  const connected = await Sandbox.connect(sbx.sandboxId, opts);
  assert.equal(connected.trafficAccessToken, token, "connect fills it too");
  await sbx.files.write("/tmp/site/index.html", "<h1>served from the sandbox</h1>");
  const server = await sbx.commands.run("cd /tmp/site && exec python3 -m http.server 8000 --bind 127.0.0.1", { background: true });
  const host = sbx.getHost(8000);
  assert.equal(host, `8000-${sbx.sandboxId}.${new URL(k.url).host}`);
  let res;
  for (let i = 0; i < 100; i++) {
    res = await request(`${k.url}/index.html`, { headers: { host, "e2b-traffic-access-token": token } });
    if (res.statusCode === 200) break;
    await res.body.dump();
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.equal(res!.statusCode, 200);
  assert.equal(await res!.body.text(), "<h1>served from the sandbox</h1>");
  const noToken = await request(`${k.url}/index.html`, { headers: { host } });
  assert.equal(noToken.statusCode, 401);
  await noToken.body.dump();
  const closed = await request(`${k.url}/`, { headers: { host: sbx.getHost(8001), "e2b-traffic-access-token": token } });
  assert.equal(closed.statusCode, 502);
  await closed.body.dump();
  await server.kill();
});

test("a built Kiln template is an E2B templateID, by reference and by the templateId a sandbox reports", async () => {
  const res = await request(`${k.url}/v1/templates/build`, {
    method: "POST",
    headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" },
    body: JSON.stringify({ name: "e2b-app", steps: [{ type: "env", envs: { APP_FLAVOUR: "kiln" } }, { type: "write_file", path: "/opt/app.txt", content: "built by kiln" }] }),
  });
  const sse = await res.body.text();
  assert.match(sse, /event: end/, sse.slice(-500));
  const s = await Sandbox.create("e2b-app", opts);
  assert.equal(await s.files.read("/opt/app.txt"), "built by kiln");
  assert.equal((await s.commands.run("echo $APP_FLAVOUR")).stdout, "kiln\n");
  const templateId = (await s.getInfo()).templateId;
  assert.match(templateId, /^tpl_/);
  const again = await Sandbox.create(templateId, opts);
  assert.equal(await again.files.read("/opt/app.txt"), "built by kiln");
  await again.kill();
  await s.kill();
});

test("getHost(port) carries a WebSocket upgrade to the sandbox's server, both ways", async () => {
  const token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
  // A minimal WebSocket server: answers 101 to the handshake, then echoes every byte upper-cased (the proxy carries
  // the bytes as they are; framing is the two ends' business).
  await sbx.files.write(
    "/tmp/upgrade.py",
    [
      "import socket",
      "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', 8002)); s.listen(1)",
      "c, _ = s.accept(); buf = b''",
      "while b'\\r\\n\\r\\n' not in buf: buf += c.recv(1024)",
      "c.sendall(b'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n\\r\\n')",
      "while True:",
      "    d = c.recv(1024)",
      "    if not d: break",
      "    c.sendall(d.upper())",
    ].join("\n"),
  );
  const server = await sbx.commands.run("exec python3 /tmp/upgrade.py", { background: true });
  const { request: httpRequest } = await import("node:http");
  const url = new URL(k.url);
  const echoed = await new Promise<string>((resolve, reject) => {
    const tryOnce = (left: number) => {
      const req = httpRequest({ host: url.hostname, port: url.port, path: "/", headers: { host: sbx.getHost(8002), connection: "Upgrade", upgrade: "websocket", "sec-websocket-version": "13", "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==", "e2b-traffic-access-token": token } });
      req.on("upgrade", (res, socket) => {
        assert.equal(res.statusCode, 101);
        socket.once("data", (d: Buffer) => {
          resolve(d.toString());
          socket.destroy();
        });
        socket.write("hello through kiln");
      });
      req.on("response", (res) => {
        res.resume();
        if (left > 0) setTimeout(() => tryOnce(left - 1), 100);
        else reject(new Error(`no upgrade: ${res.statusCode}`));
      });
      req.on("error", reject);
      req.end();
    };
    tryOnce(100);
  });
  assert.equal(echoed, "HELLO THROUGH KILN");
  await server.kill();
});

test("after a Kiln restart the same sandbox answers the same SDK object: its access token survives", async () => {
  const before = await sbx.commands.run("echo before", { background: true });
  await before.wait();
  await k.stop();
  k = await startTestKiln({ dataDir: k.dataDir });
  // Kiln listens on a new port: a new connection config, the same sandbox id and token.
  const moved = { ...opts, apiUrl: k.url, sandboxUrl: k.url };
  const again = await Sandbox.connect(sbx.sandboxId, moved);
  assert.equal((again as unknown as { envdAccessToken: string }).envdAccessToken, (sbx as unknown as { envdAccessToken: string }).envdAccessToken);
  assert.equal((await again.commands.run("echo after")).stdout, "after\n");
  assert.deepEqual(await again.commands.list(), []);
});
