// `@e2b/code-interpreter`'s default path as its user feels it: Sandbox.create() (the `code-interpreter-v1` template,
// base + numpy/pandas/matplotlib) → first runCode answered, beside native create of the same template → first
// code/execute, in the same run. The template is made (or found in the cache) before anything is timed.

import { request } from "undici";
import { Sandbox } from "@e2b/code-interpreter";
import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { generateKeyIn } from "../src/keys/service.ts";
import { CODE_INTERPRETER_REF } from "../src/templates/code-interpreter.ts";

const CREATES = Number(process.env.KILN_BENCH_E2B_CI_CREATES ?? 6);

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

  // One of each first, untimed: the template's layers into the page cache for both.
  await (await Sandbox.create(opts)).kill();
  // Alternating SDK and native, so both see the same host state.
  const sdk: number[] = [];
  const nat: number[] = [];
  for (let i = 0; i < CREATES; i++) {
    let t0 = performance.now();
    const sbx = await Sandbox.create(opts);
    const first = await sbx.runCode("1+1");
    if (first.text !== "2") throw new Error(`runCode answered ${first.text}`);
    sdk.push(performance.now() - t0);
    await sbx.kill();
    t0 = performance.now();
    const m = await native("POST", "/v1/machines", { template: CODE_INTERPRETER_REF });
    await nativeExecute(ctx.kiln.url, ctx.key, m.id, "1+1");
    nat.push(performance.now() - t0);
    await native("DELETE", `/v1/machines/${m.id}`);
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
      note: "the same template and kernel; both start the default Python kernel on first use",
    },
  ];
}
