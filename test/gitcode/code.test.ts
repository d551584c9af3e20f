// The code interpreter through the API: kernel contexts in a real machine (ipykernel through the bridge, the Node
// kernel), NDJSON executes, timeouts and disconnects that interrupt, restart, and SPEC.md's context removal.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { TEST_RUNTIME } from "../support/paths.ts";

let k: TestKiln;
let m: any;
let py: any;

before(async () => {
  k = await startTestKiln();
  m = (await k.call("POST", "/v1/machines", { body: {} })).body;
  const res = await k.call("POST", `/v1/machines/${m.id}/code/contexts`, { body: { language: "python" } });
  assert.equal(res.status, 201, res.text);
  py = res.body;
});
after(async () => k?.close());

interface Frame {
  type: string;
  [k: string]: any;
}

async function execute(body: Record<string, unknown>): Promise<{ status: number; type: string; frames: Frame[]; body: any }> {
  const res = await k.call("POST", `/v1/machines/${m.id}/code/execute`, { body });
  const type = String(res.headers["content-type"]);
  if (res.status !== 200) return { status: res.status, type, frames: [], body: res.body };
  const frames = res.text
    .split("\n")
    .filter(Boolean)
    .map((l) => JSON.parse(l) as Frame);
  return { status: res.status, type, frames, body: undefined };
}

const run = (code: string, extra: Record<string, unknown> = {}) => execute({ code, context_id: py.id, ...extra });
const resultText = (frames: Frame[]) => frames.find((f) => f.type === "result" && f.is_main_result)?.data["text/plain"];
const stdout = (frames: Frame[]) =>
  frames
    .filter((f) => f.type === "stdout")
    .map((f) => f.text)
    .join("");

async function sh(cmd: string) {
  const res = await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd, user: "root" } });
  assert.equal(res.status, 200, res.text);
  return res.body.stdout as string;
}

test("a context is {id, language, cwd} and its kernel runs as the machine's user", async () => {
  assert.match(py.id, /^ctx_[0-9a-z]{26}$/);
  assert.deepEqual(py, { id: py.id, language: "python", cwd: "/workspace" });
  const who = await run("import os, getpass; print(getpass.getuser(), os.getcwd())");
  assert.equal(stdout(who.frames), "user /workspace\n");
  const list = await k.call("GET", `/v1/machines/${m.id}/code/contexts`);
  assert.deepEqual(list.body.contexts, [py]);
});

test("state persists between executes; stdout, stderr and the result come as NDJSON frames ending with end", async () => {
  const first = await run("x = 41\nx + 1");
  assert.equal(first.status, 200);
  assert.match(first.type, /^application\/x-ndjson/);
  assert.equal(resultText(first.frames), "42");
  const second = await run("import sys\nprint('out', x)\nprint('err', file=sys.stderr)\nx * 2");
  assert.deepEqual(
    second.frames.map((f) => f.type),
    ["stdout", "stderr", "result", "end"],
  );
  assert.equal(stdout(second.frames), "out 41\n");
  assert.equal(resultText(second.frames), "82");
  const end = second.frames.at(-1)!;
  assert.equal(end.status, "ok");
  assert.equal(end.context_id, py.id);
  assert.equal(typeof end.duration_ms, "number");
  assert.equal(end.execution_count, first.frames.at(-1)!.execution_count + 1);
});

test("output keeps the order it was made in around displays and the result (a thread's too); the working directory imports, the kernel's launcher does not", async () => {
  const code = [
    "import sys, threading",
    "from IPython.display import display",
    "print('a')",
    "display('D')",
    "print('b', file=sys.stderr)",
    "print('c')",
    "t = threading.Thread(target=lambda: print('t')); t.start(); t.join()",
    "print('e', file=sys.stderr)",
    "'R'",
  ].join("\n");
  for (let i = 0; i < 3; i++) {
    const res = await run(code);
    assert.deepEqual(
      res.frames.map((f) => [f.type, f.text ?? f.data?.["text/plain"] ?? f.status]),
      [["stdout", "a\n"], ["result", "'D'"], ["stdout", "c\nt\n"], ["stderr", "b\ne\n"], ["result", "'R'"], ["end", "ok"]],
    );
  }
  const mod = await run("open('kiln_cwd_mod.py', 'w').write('X = 7')\nimport kiln_cwd_mod, sys, os\nprint([p for p in sys.path if p.rstrip('/').endswith('/kernels')])\nos.remove('kiln_cwd_mod.py')\nkiln_cwd_mod.X");
  assert.equal(stdout(mod.frames), "[]\n");
  assert.equal(resultText(mod.frames), "7");
});

test("an image/png result comes back as base64 of the exact bytes; html as text/html", async () => {
  const code = [
    "import zlib, struct, base64",
    "def chunk(t, d): return struct.pack('>I', len(d)) + t + d + struct.pack('>I', zlib.crc32(t + d) & 0xffffffff)",
    "png = b'\\x89PNG\\r\\n\\x1a\\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', 1, 1, 8, 2, 0, 0, 0)) + chunk(b'IDAT', zlib.compress(b'\\x00\\xff\\x00\\x00')) + chunk(b'IEND', b'')",
    "from IPython.display import Image, HTML, display",
    "print(base64.b64encode(png).decode())",
    "display(HTML('<b>bold</b>'))",
    "Image(data=png)",
  ].join("\n");
  const res = await run(code);
  const expected = stdout(res.frames).trim();
  const image = res.frames.find((f) => f.type === "result" && f.data["image/png"]);
  assert.ok(image, JSON.stringify(res.frames));
  assert.equal(image.is_main_result, true);
  assert.equal(image.data["image/png"].replace(/\s/g, ""), expected);
  assert.ok(Buffer.from(expected, "base64").subarray(0, 8).equals(Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])));
  const html = res.frames.find((f) => f.type === "result" && f.data["text/html"]);
  assert.equal(html?.data["text/html"], "<b>bold</b>");
  assert.equal(html?.is_main_result, false);
});

test("an exception is an error frame with name, value and traceback; the kernel goes on", async () => {
  const res = await run("def f():\n    return 1 / 0\nf()");
  const err = res.frames.find((f) => f.type === "error")!;
  assert.equal(err.name, "ZeroDivisionError");
  assert.equal(err.value, "division by zero");
  assert.match(err.traceback, /return 1 \/ 0/);
  assert.ok(!/\x1b\[/.test(err.traceback), "no terminal colour codes");
  assert.equal(res.frames.at(-1)!.type, "end");
  assert.equal(res.frames.at(-1)!.status, "error");
  assert.equal(resultText((await run("x")).frames), "41");
});

test("an execute past its timeout is interrupted and the kernel stays usable with its state", async () => {
  const started = Date.now();
  const res = await run("import time\nfor i in range(600):\n    time.sleep(0.1)", { timeout_s: 1 });
  assert.ok(Date.now() - started < 10_000);
  const names = res.frames.filter((f) => f.type === "error").map((f) => f.name);
  assert.ok(names.includes("TimeoutError"), JSON.stringify(res.frames));
  assert.ok(names.includes("KeyboardInterrupt"), JSON.stringify(res.frames));
  assert.equal(res.frames.at(-1)!.status, "timeout");
  assert.equal(resultText((await run("x + 1")).frames), "42", "same kernel, same state");
});

test("a client that disconnects interrupts its execute", async () => {
  const controller = new AbortController();
  const res = await request(`${k.url}/v1/machines/${m.id}/code/execute`, {
    method: "POST",
    headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" },
    body: JSON.stringify({ code: "import time\nprint('started', flush=True)\ntime.sleep(60)\nx = 'not reached'", context_id: py.id }),
    signal: controller.signal,
  });
  assert.equal(res.statusCode, 200);
  // Wait for the first frame so the sleep is surely running, then hang up.
  const reader = (res.body as any)[Symbol.asyncIterator]();
  const first = await reader.next();
  assert.match(Buffer.from(first.value).toString(), /started/);
  controller.abort();
  const started = Date.now();
  const next = await run("x");
  assert.ok(Date.now() - started < 10_000, "the next execute did not wait for the abandoned sleep");
  assert.equal(resultText(next.frames), "41");
});

test("restart gives a fresh kernel: a new process and no state", async () => {
  const before = Number(resultText((await run("import os; os.getpid()")).frames));
  const res = await k.call("POST", `/v1/machines/${m.id}/code/contexts/${py.id}/restart`);
  assert.equal(res.status, 200, res.text);
  assert.deepEqual(res.body, py);
  const after = Number(resultText((await run("import os; os.getpid()")).frames));
  assert.notEqual(after, before);
  assert.ok(!(await sh("ps -eo pid")).split("\n").map(Number).includes(before), "the old kernel process is gone");
  const gone = await run("x");
  assert.equal(gone.frames.find((f) => f.type === "error")?.name, "NameError");
  await run("x = 41");
});

test("a kernel that dies is reported as an error and can be restarted", async () => {
  const res = await run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)");
  const err = res.frames.find((f) => f.type === "error");
  assert.ok(err, JSON.stringify(res.frames));
  assert.equal(res.frames.at(-1)!.type, "end");
  assert.notEqual(res.frames.at(-1)!.status, "ok");
  assert.equal((await k.call("POST", `/v1/machines/${m.id}/code/contexts/${py.id}/restart`)).status, 200);
  assert.equal(resultText((await run("6 * 7")).frames), "42");
});

test("without context_id a default context per language is made on first use and then reused", async () => {
  const a = await execute({ code: "default_state = 'kept'" });
  assert.equal(a.status, 200);
  const b = await execute({ code: "default_state", language: "python" });
  assert.equal(resultText(b.frames), "'kept'");
  assert.equal(a.frames.at(-1)!.context_id, b.frames.at(-1)!.context_id);
  assert.notEqual(a.frames.at(-1)!.context_id, py.id);
  const list = await k.call("GET", `/v1/machines/${m.id}/code/contexts`);
  assert.equal(list.body.contexts.filter((c: any) => c.language === "python").length, 2);
});

test("JavaScript: state, console, top-level await, errors and interrupt in a Node kernel", async () => {
  const created = await k.call("POST", `/v1/machines/${m.id}/code/contexts`, { body: { language: "javascript", cwd: "/tmp" } });
  assert.equal(created.status, 201, created.text);
  assert.deepEqual({ ...created.body, id: "" }, { id: "", language: "javascript", cwd: "/tmp" });
  const js = (code: string, extra: Record<string, unknown> = {}) => execute({ code, context_id: created.body.id, ...extra });
  assert.equal(resultText((await js("let n = 20; const add = (a) => a + n; add(1)")).frames), "21");
  const out = await js("console.log('n is', n); console.error('oops'); process.cwd()");
  assert.equal(stdout(out.frames), "n is 20\n");
  assert.equal(out.frames.find((f) => f.type === "stderr")?.text, "oops\n");
  assert.equal(resultText(out.frames), "'/tmp'");
  assert.equal(resultText((await js("const v = await new Promise((r) => setTimeout(() => r(n * 2), 10)); v + 2")).frames), "42");
  assert.equal(resultText((await js("v")).frames), "40", "a top-level-await declaration outlives its cell");
  const err = await js("null.boom");
  assert.equal(err.frames.find((f) => f.type === "error")?.name, "TypeError");
  const loop = await js("while (true) {}", { timeout_s: 1 });
  assert.equal(loop.frames.at(-1)!.status, "timeout");
  assert.equal(resultText((await js("add(22)")).frames), "42", "usable after the interrupt");
  const who = await js("require('node:os').userInfo().username");
  assert.equal(resultText(who.frames), "'user'");
});

test("DELETE a context: 204, its kernel process is gone, then execute → 404 and a second delete → 404", async () => {
  const ctx = (await k.call("POST", `/v1/machines/${m.id}/code/contexts`, { body: {} })).body;
  const pid = Number(resultText((await execute({ code: "import os; os.getpid()", context_id: ctx.id })).frames));
  assert.ok(pid > 0);
  const del = await k.call("DELETE", `/v1/machines/${m.id}/code/contexts/${ctx.id}`);
  assert.equal(del.status, 204);
  assert.equal(del.text, "");
  assert.ok(!(await sh("ps -eo pid")).split("\n").map(Number).includes(pid), "the kernel process is gone");
  const exec = await execute({ code: "1", context_id: ctx.id });
  assert.equal(exec.status, 404);
  assert.equal(exec.body.code, "not_found");
  assert.ok(exec.body.request_id);
  const again = await k.call("DELETE", `/v1/machines/${m.id}/code/contexts/${ctx.id}`);
  assert.equal(again.status, 404);
  assert.equal(again.body.code, "not_found");
  assert.equal((await k.call("DELETE", `/v1/machines/${m.id}/code/contexts/ctx_01m8000000000000000000000`)).status, 404);
  const list = await k.call("GET", `/v1/machines/${m.id}/code/contexts`);
  assert.ok(!list.body.contexts.some((c: any) => c.id === ctx.id));
});

test("bad input is a 400 envelope and changes nothing; unknown machines are 404", async () => {
  assert.equal((await k.call("POST", `/v1/machines/${m.id}/code/contexts`, { body: { language: "ruby" } })).status, 400);
  assert.equal((await k.call("POST", `/v1/machines/${m.id}/code/contexts`, { body: { cwd: "/no/such/dir" } })).status, 400);
  assert.equal((await execute({ code: "1", extra: true })).status, 400);
  assert.equal((await execute({ code: "1", context_id: py.id, language: "python" })).status, 400);
  assert.equal((await execute({ context_id: py.id })).status, 400);
  assert.equal((await k.call("POST", "/v1/machines/mch_nope/code/execute", { body: { code: "1" } })).status, 404);
  assert.equal((await k.call("GET", "/v1/machines/mch_nope/code/contexts")).status, 404);
});

test("contexts live in the machine: a restarted Kiln finds them with their state", async () => {
  await run("survivor = 'still here'");
  await k.stop();
  k = await startTestKiln({ dataDir: k.dataDir });
  const list = await k.call("GET", `/v1/machines/${m.id}/code/contexts`);
  assert.equal(list.status, 200, list.text);
  assert.ok(list.body.contexts.some((c: any) => c.id === py.id));
  assert.equal(resultText((await run("survivor")).frames), "'still here'");
});

// The CLI does not depend on the runtime; the machine side of this is covered on gVisor by the tests above.
test("kiln code run streams a cell's output and exits non-zero when it fails", { skip: TEST_RUNTIME === "runsc" && "the CLI runs on runc only" }, async () => {
  const { execFile } = await import("node:child_process");
  const bin = new URL("../../bin/kiln", import.meta.url).pathname;
  const cli = (args: string[], input?: string) =>
    new Promise<{ code: number | null; stdout: string; stderr: string }>((resolve) => {
      const child = execFile(bin, args, { env: { ...process.env, KILN_URL: k.url, KILN_API_KEY: TEST_KEY } }, (err, stdout, stderr) =>
        resolve({ code: err ? ((err as { code?: number }).code ?? 1) : 0, stdout, stderr }),
      );
      child.stdin!.end(input ?? "");
    });
  const ok = await cli(["code", "run", m.id, "-c", py.id, "print('from cli'); 6 * 7"]);
  assert.equal(ok.code, 0, ok.stderr);
  assert.equal(ok.stdout, "from cli\n42\n");
  const piped = await cli(["code", "run", m.id, "-l", "javascript", "-"], "const z = await Promise.resolve(5); z * 2");
  assert.equal(piped.stdout, "10\n");
  const bad = await cli(["code", "run", m.id, "-c", py.id, "raise ValueError('nope')"]);
  assert.equal(bad.code, 1);
  assert.match(bad.stderr, /ValueError: nope/);
  assert.match((await cli(["code", "contexts", m.id])).stdout, new RegExp(`${py.id}\\tpython\\t/workspace`));
});
