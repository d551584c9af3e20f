// Hot-template pools: a template other than the base that is created often gets its own warm machines, and the
// code interpreter's are handed out with the default Python kernel already started. A machine handed out so has the
// create's limits, its first runCode works and sees the create's envs and the call's own, another user gets a kernel
// of its own, the pools stay within their caps, and an idle template's pool is released with nothing left behind.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { Sandbox } from "@e2b/code-interpreter";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { CODE_INTERPRETER_REF, templateConfig } from "../../src/templates/code-interpreter.ts";
import type { ResolvedTemplate } from "../../src/templates/service.ts";
import { artifactConfig } from "../../src/builder/artifact-config.ts";
import { sandboxIdOf } from "../../src/compat/e2b/ids.ts";

let k: TestKiln;
let opts: { apiKey: string; apiUrl: string; sandboxUrl: string; requestTimeoutMs: number };
// Long enough for a pooled kernel to start on a loaded host before the demand that asked for it runs out.
const IDLE_S = 120;

before(
  async () => {
    k = await startTestKiln({ env: { KILN_HOT_POOL_AFTER: "1", KILN_HOT_POOL_MAX: "2", KILN_HOT_POOL_TOTAL: "2", KILN_HOT_POOL_IDLE_S: String(IDLE_S) } });
    // Made once per cache dir (code-interpreter-template.test.ts times the cold making).
    await k.kiln.services.codeInterpreterTemplate.make();
    const key = (await k.kiln.services.keys.create("hot-pool", generateKeyIn("e2b"))).key;
    opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 60_000 };
  },
  { timeout: 30 * 60_000 },
);
after(async () => k?.close());

const hot = () => k.kiln.services.hotPools.stats();

/** Waits (bounded) until the hot pools hold `n` prepared machines; their ids. */
async function pooled(n: number): Promise<Set<string>> {
  const deadline = Date.now() + 180_000;
  for (;;) {
    const ids = hot().templates.flatMap((t) => t.ids);
    if (ids.length >= n) return new Set(ids);
    if (Date.now() > deadline) throw new Error(`the hot pool did not fill: ${JSON.stringify(hot())}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

async function execute(id: string, code: string): Promise<Record<string, any>[]> {
  const r = await k.call("POST", `/v1/machines/${id}/code/execute`, { body: { code } });
  assert.equal(r.status, 200, r.text);
  return r.text.trim().split("\n").map((l) => JSON.parse(l));
}

async function insideCaps(id: string): Promise<string> {
  const cmd = "nproc; cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max 2>/dev/null || echo no-memory-file";
  const r = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd } });
  assert.equal(r.status, 200, r.text);
  return r.body.stdout;
}

test("a pooled code-interpreter machine has the requested limits, and its first execute runs in the started kernel with the create's envs", async () => {
  // The first create of the template is its demand: booted cold, it makes the template hot.
  const first = await k.call("POST", "/v1/machines", { body: { template: CODE_INTERPRETER_REF } });
  assert.equal(first.status, 201, first.text);
  const ids = await pooled(1);
  // runc resizes a running machine; gVisor's pool serves only its own size.
  const shape = k.kiln.services.driver.resize ? { vcpus: 1, memory_mb: 768 } : {};
  const m = await k.call("POST", "/v1/machines", { body: { template: CODE_INTERPRETER_REF, envs: { KILN_HOT_MARK: "from-create" }, ...shape } });
  assert.equal(m.status, 201, m.text);
  assert.ok(ids.has(m.body.id), "handed out from the template's hot pool");
  const cold = await k.call("POST", "/v1/machines", { body: { template: CODE_INTERPRETER_REF, internet: false, ...shape } });
  assert.equal(cold.status, 201, cold.text);
  assert.ok(!ids.has(cold.body.id));
  assert.equal(await insideCaps(m.body.id), await insideCaps(cold.body.id), "the same limits as a machine booted in that size");
  // The kernel was up before the create: one context, started with the machine's user, before this execute.
  const before = await k.call("GET", `/v1/machines/${m.body.id}/code/contexts`);
  assert.equal(before.body.contexts.length, 1, before.text);
  const frames = await execute(m.body.id, "import os, getpass\n(os.environ.get('KILN_HOT_MARK'), getpass.getuser(), os.getcwd())");
  const result = frames.find((f) => f.type === "result");
  assert.equal(result?.data["text/plain"], "('from-create', 'user', '/workspace')", JSON.stringify(frames));
  const end = frames.at(-1)!;
  assert.equal(end.type, "end");
  assert.equal(end.status, "ok");
  assert.equal(end.context_id, before.body.contexts[0].id, "the prestarted kernel answered");
  assert.equal(end.execution_count, 1, "its first execute is the first the kernel counts");
  // Processes the kernel starts see the create's envs too.
  const child = await execute(m.body.id, "import subprocess\nsubprocess.run(['sh', '-c', 'echo $KILN_HOT_MARK'], capture_output=True, text=True).stdout.strip()");
  assert.equal(child.find((f) => f.type === "result")?.data["text/plain"], "'from-create'");
  for (const id of [first.body.id, m.body.id, cold.body.id]) assert.equal((await k.call("DELETE", `/v1/machines/${id}`)).status, 200);
});

test("the prestarted kernel is the template's setting: the making records it; a code-interpreter-v1 recorded before it has its name stand for it", async () => {
  const made = await k.kiln.services.templates.resolve(CODE_INTERPRETER_REF);
  assert.equal(artifactConfig(made.artifact).prestartKernel, true, `recorded: ${made.artifact.config_json}`);
  const base = await k.kiln.services.templates.resolve("local/base");
  assert.equal(templateConfig(base).prestartKernel, undefined);
  // As recorded before the setting: no artifact config at all.
  const old = { ...made, artifact: { ...made.artifact, config_json: null } } satisfies ResolvedTemplate;
  assert.equal(templateConfig(old).prestartKernel, true);
  const renamed = { ...old, template: { ...old.template, canonical_ref: "local/not-the-interpreter" } } satisfies ResolvedTemplate;
  assert.equal(templateConfig(renamed).prestartKernel, undefined);
});

test("Sandbox.create() takes a pooled machine whose first runCode sees the sandbox's and the call's envs", async () => {
  const ids = await pooled(1);
  const sbx = await Sandbox.create({ ...opts, envs: { SBX_ENV: "sandbox" }, timeoutMs: 300_000 });
  try {
    assert.ok([...ids].some((id) => sandboxIdOf(id) === sbx.sandboxId), "handed out from the hot pool");
    const e = await sbx.runCode("import os\nos.environ['SBX_ENV'] + '/' + os.environ['CALL_ENV']", { envs: { CALL_ENV: "call" } });
    assert.equal(e.error, undefined, e.error?.traceback);
    assert.equal(e.text, "'sandbox/call'");
    const after = await sbx.runCode("import os\nos.environ.get('CALL_ENV', 'gone')");
    assert.equal(after.text, "'gone'", "a call's envs apply to that call only");
  } finally {
    await sbx.kill();
  }
});

test("a create as another user does not get the pooled kernel: its first execute starts one of its own", async () => {
  const ids = await pooled(1);
  const m = await k.call("POST", "/v1/machines", { body: { template: CODE_INTERPRETER_REF, user: "root" } });
  assert.equal(m.status, 201, m.text);
  assert.ok(ids.has(m.body.id), "handed out from the hot pool");
  const contexts = await k.call("GET", `/v1/machines/${m.body.id}/code/contexts`);
  assert.equal(contexts.body.contexts.length, 0, "the kernel started for the template's user was stopped");
  const frames = await execute(m.body.id, "import os\nos.getuid()");
  assert.equal(frames.find((f) => f.type === "result")?.data["text/plain"], "0", JSON.stringify(frames));
  assert.equal((await k.call("DELETE", `/v1/machines/${m.body.id}`)).status, 200);
});

test("the hot pools stay within their caps and an idle template's pool is released with nothing left behind", async () => {
  // A server of its own with a short idle window, so the release comes soon (possibly while a kernel still starts).
  const k2 = await startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_HOT_POOL_AFTER: "1", KILN_HOT_POOL_MAX: "2", KILN_HOT_POOL_TOTAL: "2", KILN_HOT_POOL_IDLE_S: "5" } });
  try {
    const hot2 = () => k2.kiln.services.hotPools.stats();
    // A burst of creates asks for more than the caps allow.
    const made = await Promise.all(Array.from({ length: 4 }, () => k2.call("POST", "/v1/machines", { body: { template: CODE_INTERPRETER_REF } })));
    for (const r of made) assert.equal(r.status, 201, r.text);
    const seen = new Set<string>();
    for (let i = 0; i < 20; i++) {
      const s = hot2();
      assert.ok(s.total <= 2, `host-wide cap: ${JSON.stringify(s)}`);
      for (const t of s.templates) {
        assert.ok(t.ready + t.booting <= 2, `per-template cap: ${JSON.stringify(s)}`);
        for (const id of t.ids) seen.add(id);
      }
      await new Promise((r) => setTimeout(r, 50));
    }
    await Promise.all(made.map((r) => k2.call("DELETE", `/v1/machines/${r.body.id}`)));
    // No create for the idle window: the pool is released and its machines (booted or still booting) destroyed.
    const deadline = Date.now() + 5_000 + 180_000;
    while (hot2().total > 0 || hot2().templates.length > 0) {
      if (Date.now() > deadline) throw new Error(`the idle pool was not released: ${JSON.stringify(hot2())}`);
      await new Promise((r) => setTimeout(r, 200));
    }
    await k2.kiln.services.machines.cleanupsSettled(60_000);
    // Released machines are destroyed behind the release: the runtime holds nothing within a bound.
    const live = async () => [...(await k2.kiln.services.driver.listLive()).map((m) => m.id), ...((await k2.kiln.services.driver.listKnown?.()) ?? [])];
    const goneBy = Date.now() + 60_000;
    let left = await live();
    while (left.length > 0 && Date.now() < goneBy) {
      await new Promise((r) => setTimeout(r, 200));
      left = await live();
    }
    assert.deepEqual(left, [], "no machine is left in the runtime");
    for (const id of seen) assert.ok(!existsSync(`/sys/fs/cgroup/kiln/${id}`) && !existsSync(`/sys/fs/cgroup/memory/kiln/${id}`), `no cgroup left for ${id}`);
  } finally {
    await k2.close();
  }
});
