// The published `@e2b/code-interpreter` SDK, unchanged, against a real Kiln: runCode, contexts and per-call envs
// served by Kiln's own kernels (src/code/) at the sandbox's port 49999, on the base template (python3 + ipykernel,
// and the JavaScript kernel).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { Sandbox, TimeoutError } from "@e2b/code-interpreter";
import type { Execution } from "@e2b/code-interpreter";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";

let k: TestKiln;
let opts: { apiKey: string; apiUrl: string; sandboxUrl: string; requestTimeoutMs: number };
let sbx: Sandbox;

// A 1×1 PNG, shown through IPython's display as the kernel would show a chart.
const PNG_1X1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==";

before(async () => {
  k = await startTestKiln();
  const key = (await k.kiln.services.keys.create("e2b-ci", generateKeyIn("e2b"))).key;
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 60_000 };
  sbx = await Sandbox.create("base", { ...opts, timeoutMs: 600_000 });
});
after(async () => k?.close());

test("runCode keeps state between calls and gives the last expression as the main result", async () => {
  const first = await sbx.runCode("x = 41\nprint('set')");
  assert.equal(first.error, undefined);
  assert.deepEqual(first.logs.stdout, ["set\n"]);
  const second = await sbx.runCode("x + 1");
  assert.equal(second.text, "42");
  assert.equal(second.results.length, 1);
  assert.equal(second.results[0].isMainResult, true);
  assert.ok(typeof second.executionCount === "number" && second.executionCount > (first.executionCount ?? 0));
});

test("stdout and stderr stream to the callbacks as they are written", async () => {
  const out: string[] = [];
  const err: string[] = [];
  const e = await sbx.runCode("import sys\nprint('one')\nprint('two', file=sys.stderr)\nprint('three')", { onStdout: (m) => void out.push(m.line), onStderr: (m) => void err.push(m.line) });
  assert.equal(out.join(""), "one\nthree\n");
  assert.equal(err.join(""), "two\n");
  assert.equal(e.logs.stdout.join(""), "one\nthree\n");
  assert.equal(e.logs.stderr.join(""), "two\n");
});

test("an exception is the execution's error, with name, value and traceback; the context goes on", async () => {
  const errors: string[] = [];
  const e = await sbx.runCode("def f():\n    return 1 / 0\nf()", { onError: (x) => void errors.push(x.name) });
  assert.equal(e.error?.name, "ZeroDivisionError");
  assert.equal(e.error?.value, "division by zero");
  assert.match(e.error?.traceback ?? "", /ZeroDivisionError/);
  assert.deepEqual(errors, ["ZeroDivisionError"]);
  assert.equal((await sbx.runCode("x")).text, "41");
});

test("rich results: HTML and PNG through IPython's display, beside the main result", async () => {
  const e = await sbx.runCode(`from IPython.display import HTML, Image, display\nimport base64\ndisplay(HTML('<b>bold</b>'))\ndisplay(Image(data=base64.b64decode('${PNG_1X1}')))\n'done'`);
  assert.equal(e.results.length, 3);
  assert.equal(e.results[0].html, "<b>bold</b>");
  assert.equal(e.results[0].isMainResult, false);
  assert.equal(e.results[1].png?.trim(), PNG_1X1); // base64 as the kernel wrote it (IPython ends it with a newline)
  assert.ok(e.results[1].formats().includes("png"));
  assert.equal(e.text, "'done'");
});

test("JavaScript and TypeScript run on the JavaScript kernel, with its own state", async () => {
  const js = await sbx.runCode("const greeting = 'hi from js'; greeting.toUpperCase()", { language: "js" });
  assert.equal(js.error, undefined);
  assert.match(js.text ?? "", /HI FROM JS/);
  assert.match((await sbx.runCode("greeting.length", { language: "javascript" })).text ?? "", /10/);
  const ts = await sbx.runCode("const n: number = 21; n * 2", { language: "ts" });
  assert.equal(ts.error, undefined, JSON.stringify(ts.error));
  assert.match(ts.text ?? "", /42/);
  const logs = await sbx.runCode("console.log('to stdout'); console.error('to stderr')", { language: "js" });
  assert.deepEqual([logs.logs.stdout.join(""), logs.logs.stderr.join("")], ["to stdout\n", "to stderr\n"]);
});

test("code contexts: created with a cwd, listed, isolated, restarted (state gone) and removed", async () => {
  const ctx = await sbx.createCodeContext({ language: "python", cwd: "/tmp" });
  assert.match(ctx.id, /\S/);
  assert.equal(ctx.cwd, "/tmp");
  assert.equal((await sbx.runCode("import os; os.getcwd()", { context: ctx })).text, "'/tmp'");
  await sbx.runCode("only_here = 7", { context: ctx });
  assert.equal((await sbx.runCode("only_here", { context: ctx })).text, "7");
  assert.equal((await sbx.runCode("only_here")).error?.name, "NameError");
  assert.ok((await sbx.listCodeContexts()).some((c) => c.id === ctx.id && c.language === "python"));
  await sbx.restartCodeContext(ctx);
  assert.equal((await sbx.runCode("only_here", { context: ctx })).error?.name, "NameError");
  await sbx.removeCodeContext(ctx.id);
  assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id));
  await assert.rejects(sbx.runCode("1", { context: ctx }));
  // Both at once is the SDK's own refusal (its types forbid it too).
  await assert.rejects(sbx.runCode("1", { context: ctx, language: "python" } as never), /context or language/);
});

test("envs apply to one runCode only, in Python and JavaScript", async () => {
  assert.equal((await sbx.runCode("import os; os.environ.get('RUN_ONLY')", { envs: { RUN_ONLY: "yes" } })).text, "'yes'");
  assert.equal((await sbx.runCode("import os; repr(os.environ.get('RUN_ONLY'))")).text, "'None'");
  // A variable the kernel already has is given back its value after the call.
  const home = (await sbx.runCode("import os; os.environ['HOME']")).text;
  assert.equal((await sbx.runCode("import os; os.environ['HOME']", { envs: { HOME: "/tmp/run-only" } })).text, "'/tmp/run-only'");
  assert.equal((await sbx.runCode("import os; os.environ['HOME']")).text, home);
  assert.match((await sbx.runCode("process.env.RUN_ONLY", { language: "js", envs: { RUN_ONLY: "js-yes" } })).text ?? "", /js-yes/);
  assert.match((await sbx.runCode("String(process.env.RUN_ONLY)", { language: "js" })).text ?? "", /undefined/);
});

test("a runCode past its timeoutMs is a TimeoutError, and the interrupted kernel keeps its state", async () => {
  const t0 = Date.now();
  await assert.rejects(sbx.runCode("import time\ntime.sleep(60)", { timeoutMs: 1500 }), (err: unknown) => err instanceof TimeoutError);
  // The SDK's clock starts when the answer's headers arrive: they come at once, not with the first output.
  assert.ok(Date.now() - t0 < 10_000, `timed out after ${Date.now() - t0} ms`);
  // The client went away: the execution was interrupted, so the next one runs at once, in the same state.
  const started = Date.now();
  const next = await sbx.runCode("x * 2");
  assert.equal(next.text, "82");
  assert.ok(Date.now() - started < 30_000);
});

test("one execution at a time per context: a second waits for the first", async () => {
  const done: string[] = [];
  const track = (name: string) => (e: Execution) => {
    done.push(name);
    return e;
  };
  await Promise.all([sbx.runCode("import time\ntime.sleep(1.5)\n'slow'").then(track("slow")), new Promise((r) => setTimeout(r, 200)).then(() => sbx.runCode("'fast'").then(track("fast")))]);
  assert.deepEqual(done, ["slow", "fast"]);
});

test("the 49999-<id> Host form and the health route answer as E2B's; a wrong token is refused", async () => {
  const token = sbx.trafficAccessToken!;
  const host = `49999-${sbx.sandboxId}.kiln.test`;
  const health = await request(`${k.url}/health`, { headers: { host, "e2b-traffic-access-token": token } });
  assert.equal(health.statusCode, 200);
  await health.body.dump();
  const exec = await request(`${k.url}/execute`, { method: "POST", headers: { host, "x-access-token": token, "content-type": "application/json" }, body: JSON.stringify({ code: "6 * 7" }) });
  assert.equal(exec.statusCode, 200);
  const lines = (await exec.body.text()).trim().split("\n").map((l) => JSON.parse(l) as { type: string; text?: string; execution_count?: number });
  assert.deepEqual(
    lines.filter((l) => l.type !== "keepalive").map((l) => l.type),
    ["result", "number_of_executions", "end_of_execution"],
  );
  assert.equal(lines.find((l) => l.type === "result")?.text, "42");
  const refused = await request(`${k.url}/contexts`, { headers: { host, "e2b-traffic-access-token": "nope" } });
  assert.equal(refused.statusCode, 401);
  await refused.body.dump();
  const badLanguage = await request(`${k.url}/execute`, { method: "POST", headers: { host, "x-access-token": token, "content-type": "application/json" }, body: JSON.stringify({ code: "1", language: "cobol" }) });
  assert.equal(badLanguage.statusCode, 400);
  assert.match(((await badLanguage.body.json()) as { message: string }).message, /cobol/);
});

test("runCode on a killed sandbox is the SDK's TimeoutError (502, as E2B's proxy answers)", async () => {
  const s = await Sandbox.create("base", opts);
  assert.equal((await s.runCode("1 + 1")).text, "2");
  await s.kill();
  await assert.rejects(s.runCode("1 + 1"), (err: unknown) => err instanceof TimeoutError);
});
