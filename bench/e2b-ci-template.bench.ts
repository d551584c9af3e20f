// `@e2b/code-interpreter`'s default path as its user feels it: Sandbox.create() (the `code-interpreter-v1` template,
// base + numpy/pandas/matplotlib) → first runCode answered, beside native create of the same template → first
// code/execute, in the same run. The template is made (or found in the cache) before anything is timed. Both take a
// machine from the template's hot pool (its default kernel already started), refilled before each create as on a host
// that is not saturated; a second row sets that beside the cold path (a machine booted for the create, its kernel
// started by the first execute), which every create took before the template had a pool.

import { request } from "undici";
import { Sandbox } from "@e2b/code-interpreter";
import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { generateKeyIn } from "../src/keys/service.ts";
import { CODE_INTERPRETER_REF } from "../src/templates/code-interpreter.ts";

// 12: a fresh kernel's first execute varies 12–40 ms on its own (both paths pay it), so fewer samples make a noisy median.
const CREATES = Number(process.env.KILN_BENCH_E2B_CI_CREATES ?? 12);

async function nativeExecute(url: string, key: string, id: string, code: string): Promise<void> {
  const res = await request(`${url}/v1/machines/${id}/code/execute`, { method: "POST", headers: { authorization: `Bearer ${key}`, "content-type": "application/json" }, body: JSON.stringify({ code }) });
  const text = await res.body.text();
  if (res.statusCode !== 200 || !text.includes('"type":"end"')) throw new Error(`execute: ${res.statusCode} ${text}`);
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  await ctx.kiln.kiln.services.codeInterpreterTemplate.make();
  const key = (await ctx.kiln.kiln.services.keys.create("bench-e2b-ci-template", generateKeyIn("e2b"))).key;
  const opts = { apiKey: key, apiUrl: ctx.kiln.url, sandboxUrl: ctx.kiln.url, timeoutMs: 300_000 };
  const native = (method: string, path: string, body?: unknown) => api(ctx.kiln.url, ctx.key, method, path, body);

  // One of each first, untimed: the template's layers into the page cache for both, and its demand (it is hot now).
  await (await Sandbox.create(opts)).kill();
  await native("DELETE", `/v1/machines/${(await native("POST", "/v1/machines", { template: CODE_INTERPRETER_REF })).id}`);
  const hot = ctx.kiln.kiln.services.hotPools;
  // Before each timed create: the pool refilled, as on a host that is not saturated, and no machine's cleanup still
  // running behind its DELETE (the cold create's would otherwise overlap only the SDK's next create).
  const cleaned = ctx.kiln.kiln.services.teardown;
  const refilled = async () => {
    const deadline = Date.now() + 120_000;
    while (Date.now() < deadline && (!hot.stats().templates.some((t) => t.size > 0 && t.ready >= t.size) || cleaned.pending().count > 0)) await new Promise((r) => setTimeout(r, 20));
  };
  // Alternating SDK and native, so both see the same host state.
  const sdk: number[] = [];
  const nat: number[] = [];
  const cold: number[] = [];
  for (let i = 0; i < CREATES; i++) {
    await refilled();
    let t0 = performance.now();
    const sbx = await Sandbox.create(opts);
    const first = await sbx.runCode("1+1");
    if (first.text !== "2") throw new Error(`runCode answered ${first.text}`);
    sdk.push(performance.now() - t0);
    await sbx.kill();
    await refilled();
    t0 = performance.now();
    const m = await native("POST", "/v1/machines", { template: CODE_INTERPRETER_REF });
    await nativeExecute(ctx.kiln.url, ctx.key, m.id, "1+1");
    nat.push(performance.now() - t0);
    await native("DELETE", `/v1/machines/${m.id}`);
    // The cold path: internet off is a shape no pool holds, so the machine boots for this create.
    t0 = performance.now();
    const c = await native("POST", "/v1/machines", { template: CODE_INTERPRETER_REF, internet: false });
    await nativeExecute(ctx.kiln.url, ctx.key, c.id, "1+1");
    cold.push(performance.now() - t0);
    await native("DELETE", `/v1/machines/${c.id}`);
  }
  return [
    {
      name: `E2B code interpreter: Sandbox.create() (code-interpreter-v1) → first runCode answered (${CREATES} sandboxes)`,
      unit: "ms",
      better: "lower",
      median: median(sdk),
      p99: percentile(sdk, 99),
      baseline: { name: `native POST /v1/machines {template: ${CODE_INTERPRETER_REF}} → first code/execute`, median: median(nat), p99: percentile(nat, 99) },
      goal: "≤ 1.3× native",
      note: "the same template and hot pool; both find the default Python kernel started",
    },
    {
      name: `native create of ${CODE_INTERPRETER_REF} → first code/execute, from its hot pool (kernel started)`,
      unit: "ms",
      better: "lower",
      median: median(nat),
      p99: percentile(nat, 99),
      baseline: { name: "the same on a machine booted for the create (internet off), its kernel started by the first execute", median: median(cold), p99: percentile(cold, 99) },
      goal: "≤ 1 s",
    },
  ];
}
