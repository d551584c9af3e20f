// The E2B compatibility layer's cost as a user of the `e2b` SDK feels it: Sandbox.create() → first
// commands.run("true") answered, and the commands.run round trip, each beside the same operation through Kiln's
// native API in the same run (the same machine shape, the same `/bin/bash -l -c true` the SDK sends).

import { Sandbox } from "e2b";
import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { generateKeyIn } from "../src/keys/service.ts";

const CREATES = Number(process.env.KILN_BENCH_E2B_CREATES ?? 20);
const RUNS = 200;
const BASH_TRUE = { cmd: "/bin/bash", args: ["-l", "-c", "true"] };

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const key = (await ctx.kiln.kiln.services.keys.create("bench-e2b", generateKeyIn("e2b"))).key;
  const opts = { apiKey: key, apiUrl: ctx.kiln.url, sandboxUrl: ctx.kiln.url };
  const native = (method: string, path: string, body?: unknown) => api(ctx.kiln.url, ctx.key, method, path, body);
  const pool = ctx.kiln.kiln.services.pool;
  // Before each timed create: the pool refilled and no DELETE's cleanup still running behind its answer.
  const teardown = ctx.kiln.kiln.services.teardown;
  const poolRefilled = async () => {
    for (let w = 0; w < 400 && (pool.stats().ready < pool.stats().size || teardown.pending().count > 0); w++) await new Promise((r) => setTimeout(r, 10));
  };

  // Alternating SDK and native creates, so both see the same pool and host state.
  const sdkCreate: number[] = [];
  const nativeCreate: number[] = [];
  for (let i = 0; i < CREATES; i++) {
    await poolRefilled();
    let t0 = performance.now();
    const sbx = await Sandbox.create("base", { ...opts, timeoutMs: 300_000 });
    await sbx.commands.run("true");
    sdkCreate.push(performance.now() - t0);
    await sbx.kill();
    await poolRefilled();
    t0 = performance.now();
    const m = await native("POST", "/v1/machines", { template: "local/base" });
    await native("POST", `/v1/machines/${m.id}/exec`, BASH_TRUE);
    nativeCreate.push(performance.now() - t0);
    await native("DELETE", `/v1/machines/${m.id}`);
  }

  const sbx = await Sandbox.create("base", { ...opts, timeoutMs: 300_000 });
  const sdkRun: number[] = [];
  const nativeRun: number[] = [];
  for (let i = 0; i < 10; i++) await sbx.commands.run("true"); // warm-up: the agent stream socket, undici pools
  for (let i = 0; i < 10; i++) await native("POST", `/v1/machines/mch_${sbx.sandboxId}/exec`, BASH_TRUE);
  for (let i = 0; i < RUNS; i++) {
    let t0 = performance.now();
    await sbx.commands.run("true");
    sdkRun.push(performance.now() - t0);
    t0 = performance.now();
    await native("POST", `/v1/machines/mch_${sbx.sandboxId}/exec`, BASH_TRUE);
    nativeRun.push(performance.now() - t0);
  }
  await sbx.kill();

  return [
    {
      name: `E2B SDK: Sandbox.create() → first commands.run("true") answered (${CREATES} sandboxes)`,
      unit: "ms",
      better: "lower",
      median: median(sdkCreate),
      p99: percentile(sdkCreate, 99),
      baseline: { name: "native POST /v1/machines → POST …/exec of the same command", median: median(nativeCreate), p99: percentile(nativeCreate, 99) },
      goal: "≤ 1.3× native",
      note: "warm pool refilled between creates",
    },
    {
      name: `E2B SDK: commands.run("true") round trip (${RUNS} runs)`,
      unit: "ms",
      better: "lower",
      median: median(sdkRun),
      p99: percentile(sdkRun, 99),
      baseline: { name: "native POST …/exec of /bin/bash -l -c true", median: median(nativeRun), p99: percentile(nativeRun, 99) },
      goal: "≤ 1.3× native",
      note: "SDK: Connect server stream over the machine's shared agent stream socket",
    },
  ];
}
