// `@e2b/code-interpreter` as its user feels it, beside Kiln's native code API in the same run: runCode("1+1") in a
// warm default context (beside POST /v1/machines/{id}/code/execute of the same code), and Sandbox.create() → first
// runCode answered (beside native create → first execute; both start a default Python kernel).

import { request } from "undici";
import { Sandbox } from "@e2b/code-interpreter";
import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { generateKeyIn } from "../src/keys/service.ts";

const RUNS = Number(process.env.KILN_BENCH_E2B_CODE_RUNS ?? 200);
const CREATES = Number(process.env.KILN_BENCH_E2B_CODE_CREATES ?? 6);

async function nativeExecute(url: string, key: string, id: string, code: string): Promise<void> {
  const res = await request(`${url}/v1/machines/${id}/code/execute`, { method: "POST", headers: { authorization: `Bearer ${key}`, "content-type": "application/json" }, body: JSON.stringify({ code }) });
  const text = await res.body.text();
  if (res.statusCode !== 200 || !text.includes('"type":"end"')) throw new Error(`execute: ${res.statusCode} ${text}`);
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const key = (await ctx.kiln.kiln.services.keys.create("bench-e2b-code", generateKeyIn("e2b"))).key;
  const opts = { apiKey: key, apiUrl: ctx.kiln.url, sandboxUrl: ctx.kiln.url, timeoutMs: 300_000 };
  const native = (method: string, path: string, body?: unknown) => api(ctx.kiln.url, ctx.key, method, path, body);

  // Alternating SDK and native, so both see the same host state.
  const sdkCreate: number[] = [];
  const nativeCreate: number[] = [];
  for (let i = 0; i < CREATES; i++) {
    let t0 = performance.now();
    const sbx = await Sandbox.create("base", opts);
    const first = await sbx.runCode("1+1");
    if (first.text !== "2") throw new Error(`runCode answered ${first.text}`);
    sdkCreate.push(performance.now() - t0);
    await sbx.kill();
    t0 = performance.now();
    const m = await native("POST", "/v1/machines", { template: "local/base" });
    await nativeExecute(ctx.kiln.url, ctx.key, m.id, "1+1");
    nativeCreate.push(performance.now() - t0);
    await native("DELETE", `/v1/machines/${m.id}`);
  }

  const sbx = await Sandbox.create("base", opts);
  for (let i = 0; i < 10; i++) await sbx.runCode("1+1"); // warm-up: the default context, connection pools
  for (let i = 0; i < 10; i++) await nativeExecute(ctx.kiln.url, ctx.key, `mch_${sbx.sandboxId}`, "1+1");
  const sdkRun: number[] = [];
  const nativeRun: number[] = [];
  for (let i = 0; i < RUNS; i++) {
    let t0 = performance.now();
    await sbx.runCode("1+1");
    sdkRun.push(performance.now() - t0);
    t0 = performance.now();
    await nativeExecute(ctx.kiln.url, ctx.key, `mch_${sbx.sandboxId}`, "1+1");
    nativeRun.push(performance.now() - t0);
  }
  await sbx.kill();

  return [
    {
      name: `E2B code interpreter: runCode("1+1") round trip (${RUNS} runs, warm default context)`,
      unit: "ms",
      better: "lower",
      median: median(sdkRun),
      p99: percentile(sdkRun, 99),
      baseline: { name: "native POST /v1/machines/{id}/code/execute of 1+1 (same context)", median: median(nativeRun), p99: percentile(nativeRun, 99) },
      goal: "≤ 1.2× native",
      note: "the same kernel; E2B's NDJSON translated line by line",
    },
    {
      name: `E2B code interpreter: Sandbox.create("base") → first runCode answered (${CREATES} sandboxes)`,
      unit: "ms",
      better: "lower",
      median: median(sdkCreate),
      p99: percentile(sdkCreate, 99),
      baseline: { name: "native POST /v1/machines → first code/execute", median: median(nativeCreate), p99: percentile(nativeCreate, 99) },
      goal: "≤ 1.3× native",
      note: "both start the default Python kernel on first use",
    },
  ];
}
