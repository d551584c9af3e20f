// `Sandbox.create()` of the published `@e2b/code-interpreter`, unchanged: its default template `code-interpreter-v1`
// is made by Kiln on first use (503, retryable, meanwhile) — once per cache dir, so once per test run — and serves
// numpy, pandas and matplotlib through runCode.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { Sandbox } from "@e2b/code-interpreter";
import { Template } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cliPipes } from "../support/cli.ts";
import { TEST_CACHE_DIR } from "../support/paths.ts";

let k: TestKiln;
let opts: { apiKey: string; apiUrl: string; sandboxUrl: string; requestTimeoutMs: number };
let sbx: Sandbox;
// Making the template on a cold cache: apt installs ~1 GB of Debian packages (11 min measured at load 13).
const MAKE_BOUND_MS = 25 * 60_000;

/** Creates with the SDK's default template, retrying while Kiln answers that it is being made; the 503s seen. */
async function createWhileMade(): Promise<{ sandbox: Sandbox; waits: string[] }> {
  const waits: string[] = [];
  const deadline = Date.now() + MAKE_BOUND_MS;
  for (;;) {
    try {
      return { sandbox: await Sandbox.create({ ...opts, timeoutMs: 600_000 }), waits };
    } catch (err) {
      const message = (err as Error).message;
      if (!/temporarily unavailable/.test(message) || Date.now() > deadline) throw err;
      waits.push(message);
      // Not a guess at how long it takes: a bounded poll of the answer the SDK user would retry on.
      await new Promise((r) => setTimeout(r, waits.length === 1 ? 200 : 3000));
    }
  }
}

before(
  async () => {
    k = await startTestKiln();
    const key = (await k.kiln.services.keys.create("e2b-ci-template", generateKeyIn("e2b"))).key;
    opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 60_000 };
    const { sandbox, waits } = await createWhileMade();
    sbx = sandbox;
    for (const w of waits) assert.match(w, /code-interpreter-v1.*being made/);
  },
  { timeout: MAKE_BOUND_MS + 120_000 },
);
after(async () => k?.close());

test("Sandbox.create() without a template runs in code-interpreter-v1, a Kiln template with numpy and pandas", async () => {
  const info = await sbx.getInfo();
  const t = await k.call("GET", "/v1/templates/local%2Fcode-interpreter-v1");
  assert.equal(t.status, 200, t.text);
  assert.equal(info.templateId, t.body.template_id);
  const e = await sbx.runCode("import numpy as np, pandas as pd\nint(np.arange(10).sum())");
  assert.equal(e.error, undefined, e.error?.traceback);
  assert.equal(e.text, "45");
});

test("a matplotlib figure is a PNG result", async () => {
  const e = await sbx.runCode("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 1, 9])\nplt.title('kiln')\nplt.show()");
  assert.equal(e.error, undefined, e.error?.traceback);
  const png = e.results.find((r) => r.png)?.png;
  assert.ok(png, `no PNG among ${JSON.stringify(e.results.map((r) => r.formats()))}`);
  const bytes = Buffer.from(png, "base64");
  assert.deepEqual([...bytes.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);
  assert.ok(bytes.length > 2000, `a real plot, not a placeholder: ${bytes.length} bytes`);
});

test("a pandas DataFrame is a table result, as HTML and as text", async () => {
  const e = await sbx.runCode("import pandas as pd\npd.DataFrame({'name': ['ada', 'bob'], 'score': [3, 5]})");
  assert.equal(e.error, undefined, e.error?.traceback);
  const main = e.results.find((r) => r.isMainResult);
  assert.ok(main, "the DataFrame is the main result");
  assert.match(main.html ?? "", /<table[\s\S]*<td>ada<\/td>[\s\S]*<td>5<\/td>[\s\S]*<\/table>/);
  assert.match(main.text ?? "", /name\s+score\s*\n0\s+ada\s+3\s*\n1\s+bob\s+5/);
});

test("the JavaScript kernel runs there too", async () => {
  const e = await sbx.runCode("const xs = [1, 2, 3]; xs.map((x) => x * 2).join(',')", { language: "js" });
  assert.equal(e.error, undefined, e.error?.traceback);
  assert.equal(e.text, "'2,4,6'"); // a string result shown as Node shows it, as E2B's JavaScript kernel does
});

test("while the template is missing a create answers 503 (retryable) and starts making it; a later create works", async () => {
  // Deleting the record (the cached layer stays) puts the server back at first use: the making is then fast.
  await sbx.kill();
  const del = await k.call("DELETE", "/v1/templates/local%2Fcode-interpreter-v1");
  assert.equal(del.status, 200, del.text);
  await assert.rejects(Sandbox.create(opts), (err: unknown) => {
    assert.match((err as Error).message, /temporarily unavailable.*code-interpreter-v1.*being made.*kiln templates init-code-interpreter/s);
    return true;
  });
  const { sandbox } = await createWhileMade();
  sbx = sandbox;
  assert.equal((await sbx.runCode("import matplotlib; matplotlib.__version__")).error, undefined);
});

test("Template.exists answers from Kiln's templates (name, tag); a tag move of an unknown template is E2B's 404 (the builder: template-builder.test.ts, tag moves: template-tags.test.ts)", async () => {
  const o = { apiKey: opts.apiKey, apiUrl: opts.apiUrl };
  assert.equal(await Template.exists("code-interpreter-v1", o), true);
  assert.equal(await Template.exists("base", o), true);
  assert.equal(await Template.exists("base:default", o), true);
  assert.equal(await Template.exists("base:no-such-tag", o), false);
  assert.equal(await Template.exists("no-such-template-here", o), false);
  const bad = await k.call("GET", "/templates/aliases/not%20a%20ref", { headers: { "x-api-key": opts.apiKey }, key: null });
  assert.equal(bad.status, 400);
  assert.equal(bad.body.code, 400);
  const stranger = await k.call("GET", "/templates/aliases/base", { key: null });
  assert.equal(stranger.status, 401);
  await assert.rejects(Template.assignTags("no-such-template-here:default", "production", o), (err: unknown) => {
    assert.match((err as Error).message, /^404: No template "no-such-template-here"/);
    return true;
  });
});

test("kiln templates init-code-interpreter makes (here: finds in the cache) and records it ahead of time", { timeout: MAKE_BOUND_MS }, async () => {
  const dataDir = await mkdtemp(join(tmpdir(), "kiln-ci-cli-"));
  try {
    const run = cliPipes(k.url, ["templates", "init-code-interpreter"], { KILN_DATA_DIR: dataDir, KILN_CACHE_DIR: TEST_CACHE_DIR });
    assert.equal(await run.exited, 0, run.stderr());
    const printed = /^local\/code-interpreter-v1 (art_\S+) ready in [\d.]+ s at (\S+)\n$/.exec(run.stdout());
    assert.ok(printed, run.stdout());
    // A server started on that data dir finds it recorded: the CLI's artifact, not one of its own.
    const other = await startTestKiln({ dataDir });
    try {
      const t = await other.call("GET", "/v1/templates/local%2Fcode-interpreter-v1");
      assert.equal(t.status, 200, t.text);
      assert.match(t.text, new RegExp(printed[1]!));
    } finally {
      await other.close();
    }
  } finally {
    await rm(dataDir, { recursive: true, force: true });
  }
});
