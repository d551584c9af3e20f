// Template build latencies a user feels: the first SSE byte after POST /v1/templates/build, a fully cached rebuild
// to `end`, and a 5-step declarative build cold and with its first 4 steps cached — each beside running the same
// commands directly in a machine through exec, in the same run.

import { request } from "undici";
import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const ROUNDS = Number(process.env.KILN_BENCH_BUILDS ?? 30);
const COLD_ROUNDS = Number(process.env.KILN_BENCH_COLD_BUILDS ?? 5);

const commands = (last: string) => ["echo one > /one", "echo two > /two", "echo three > /three", "echo four > /four", `echo ${last} > /five`];
const body = (name: string, last: string, extra: Record<string, unknown> = {}) => ({ name, steps: commands(last).map((command) => ({ type: "run", command })), ...extra });

/** Sends a build; resolves the time to the first body byte and to the terminal entry. */
async function timedBuild(ctx: BenchContext, payload: unknown): Promise<{ firstByte: number; end: number; last: string }> {
  const t0 = performance.now();
  const res = await request(ctx.kiln.url + "/v1/templates/build", { method: "POST", headers: { authorization: `Bearer ${ctx.key}`, "content-type": "application/json" }, body: JSON.stringify(payload) });
  let firstByte = 0;
  let text = "";
  for await (const chunk of res.body) {
    if (!firstByte) firstByte = performance.now() - t0;
    text += chunk.toString();
  }
  const end = performance.now() - t0;
  const lastEvent = /event: (\w+)\n(?![\s\S]*event: )/.exec(text)?.[1] ?? "?";
  if (lastEvent !== "end") throw new Error(`build ended ${lastEvent}: ${text.slice(-500)}`);
  return { firstByte, end, last: lastEvent };
}

async function healthRoundTrip(url: string): Promise<number> {
  const t0 = performance.now();
  const res = await request(url + "/health");
  await res.body.text();
  return performance.now() - t0;
}

/** The same commands run directly: create a machine, exec each, destroy it. */
async function direct(ctx: BenchContext, cmds: string[]): Promise<number> {
  const t0 = performance.now();
  const m = await api(ctx.kiln.url, ctx.key, "POST", "/v1/machines", { template: "local/base", user: "root", vcpus: 2 });
  for (const cmd of cmds) {
    const r = await api(ctx.kiln.url, ctx.key, "POST", `/v1/machines/${m.id}/exec`, { cmd });
    if (r.exit_code !== 0) throw new Error(`${cmd} exited ${r.exit_code}`);
  }
  const took = performance.now() - t0;
  await api(ctx.kiln.url, ctx.key, "DELETE", `/v1/machines/${m.id}`);
  return took;
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const results: BenchResult[] = [];
  await timedBuild(ctx, body("bench-cached", "five"));
  for (let i = 0; i < 3; i++) await healthRoundTrip(ctx.kiln.url);

  const firstBytes: number[] = [];
  const cachedEnds: number[] = [];
  const health: number[] = [];
  for (let i = 0; i < ROUNDS; i++) {
    const r = await timedBuild(ctx, body("bench-cached", "five"));
    firstBytes.push(r.firstByte);
    cachedEnds.push(r.end);
    health.push(await healthRoundTrip(ctx.kiln.url));
  }
  const healthBaseline = { name: "GET /health round trip", median: median(health), p99: percentile(health, 99) };
  results.push({ name: "template build: first SSE byte after the request", unit: "ms", better: "lower", median: median(firstBytes), p99: percentile(firstBytes, 99), baseline: healthBaseline, goal: "p50 ≤ 20 ms" });
  results.push({ name: "template build: fully cached rebuild to `end`", unit: "ms", better: "lower", median: median(cachedEnds), p99: percentile(cachedEnds, 99), baseline: healthBaseline, goal: "≤ 150 ms", note: "5 steps, final_artifact hit: no step runs" });

  const cold: number[] = [];
  const coldDirect: number[] = [];
  const warm4: number[] = [];
  const warm4Direct: number[] = [];
  for (let i = 0; i < COLD_ROUNDS; i++) {
    const token = `t${Date.now()}${i}`;
    // As the create benches wait for the warm pool's refill: the build machine booted ahead after the last build is up.
    await ctx.kiln.kiln.services.builds.settle();
    cold.push((await timedBuild(ctx, body(`bench-cold-${i}`, token, { skip_cache: true }))).end);
    coldDirect.push(await direct(ctx, commands(token)));
    const changed = `${token}x`;
    await ctx.kiln.kiln.services.builds.settle();
    warm4.push((await timedBuild(ctx, body(`bench-cold-${i}`, changed))).end);
    warm4Direct.push(await direct(ctx, commands(changed).slice(4)));
  }
  results.push({
    name: "5-step declarative build, cold",
    unit: "ms",
    better: "lower",
    median: median(cold),
    p99: percentile(cold, 99),
    baseline: { name: "the same 5 commands through exec in a new machine", median: median(coldDirect), p99: percentile(coldDirect, 99) },
    goal: "≤ 1.5× the exec baseline",
    note: "skip_cache; the steps run in one build machine, booted ahead after the last build (waited for, as the create rows wait for the pool's refill), each on a new upper dir swapped in under its agent (runc)",
  });
  results.push({
    name: "5-step declarative build, first 4 steps cached",
    unit: "ms",
    better: "lower",
    median: median(warm4),
    p99: percentile(warm4, 99),
    baseline: { name: "the 1 changed command through exec in a new machine", median: median(warm4Direct), p99: percentile(warm4Direct, 99) },
    goal: "≤ 1.5× the exec baseline",
  });
  return results;
}
