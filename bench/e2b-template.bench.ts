// E2B's template builder as its user feels it: `Template.build` of a copy + two runCmd template through the `e2b`
// SDK (request, upload, steps, status polls until ready), cold and fully cached, beside the same build through Kiln's
// own POST /v1/templates/build (blob upload, then the SSE stream to `end`), in the same run.

import { createHash } from "node:crypto";
import { mkdtemp, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { request } from "undici";
import { Template } from "e2b";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { generateKeyIn } from "../src/keys/service.ts";

const COLD = Number(process.env.KILN_BENCH_E2B_TEMPLATE_COLD ?? 4);
const CACHED = Number(process.env.KILN_BENCH_E2B_TEMPLATE_CACHED ?? 10);

async function native(ctx: BenchContext, name: string, content: string, marker: string): Promise<number> {
  const t0 = performance.now();
  const sha = createHash("sha256").update(content).digest("hex");
  const put = await request(`${ctx.kiln.url}/v1/templates/blobs/${sha}`, { method: "PUT", headers: { authorization: `Bearer ${ctx.key}`, "content-type": "application/octet-stream" }, body: content });
  await put.body.text();
  const body = {
    name,
    context: { files: [{ path: "hello.txt", sha256: sha }] },
    steps: [
      { type: "copy", src: "hello.txt", dest: "/data/" },
      { type: "run", command: `echo ${marker} > /marker` },
      { type: "run", command: "cat /data/hello.txt > /copy" },
    ],
  };
  const res = await request(`${ctx.kiln.url}/v1/templates/build`, { method: "POST", headers: { authorization: `Bearer ${ctx.key}`, "content-type": "application/json" }, body: JSON.stringify(body) });
  const text = await res.body.text();
  if (!/event: end\n(?![\s\S]*event: )/.test(text)) throw new Error(`native build did not end: ${text.slice(-400)}`);
  return performance.now() - t0;
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const key = (await ctx.kiln.kiln.services.keys.create("bench-e2b-template", generateKeyIn("e2b"))).key;
  const opts = { apiKey: key, apiUrl: ctx.kiln.url, requestTimeoutMs: 300_000 };
  const dir = await mkdtemp(join(tmpdir(), "bench-e2b-tpl-"));

  const e2b = async (name: string, content: string, marker: string) => {
    await writeFile(join(dir, "hello.txt"), content);
    const tpl = Template({ fileContextPath: dir }).fromBaseImage().copy("hello.txt", "/data/").runCmd(`echo ${marker} > /marker`).runCmd("cat /data/hello.txt > /copy");
    const t0 = performance.now();
    await Template.build(tpl, name, opts);
    return performance.now() - t0;
  };

  // Cold: new file bytes and a new marker each round, so no step is cached; alternated so load hits both alike.
  const coldE2b: number[] = [];
  const coldNative: number[] = [];
  for (let i = 0; i < COLD; i++) {
    const tag = `${Date.now()}-${i}`;
    coldE2b.push(await e2b("bench-e2b-tpl", `e2b ${tag}\n`, `e${tag}`));
    coldNative.push(await native(ctx, "bench-native-tpl", `native ${tag}\n`, `n${tag}`));
  }
  // Cached: the same template again (the final-artifact cache answers).
  await e2b("bench-e2b-tpl-c", "same\n", "same");
  await native(ctx, "bench-native-tpl-c", "same\n", "same");
  const cachedE2b: number[] = [];
  const cachedNative: number[] = [];
  for (let i = 0; i < CACHED; i++) {
    cachedE2b.push(await e2b("bench-e2b-tpl-c", "same\n", "same"));
    cachedNative.push(await native(ctx, "bench-native-tpl-c", "same\n", "same"));
  }

  return [
    {
      name: `E2B Template.build (copy + 2 runCmd on the base template), cold (${COLD} builds)`,
      unit: "ms",
      better: "lower",
      median: median(coldE2b),
      p99: percentile(coldE2b, 99),
      baseline: { name: "the same steps through POST /v1/templates/build (blob PUT + SSE to end)", median: median(coldNative), p99: percentile(coldNative, 99) },
      goal: "≤ 1.3× native",
      note: "the SDK polls the status every 200 ms (its logsRefreshFrequency) and hashes/tars the copy itself",
    },
    {
      name: `E2B Template.build of an unchanged template, fully cached (${CACHED} builds)`,
      unit: "ms",
      better: "lower",
      median: median(cachedE2b),
      p99: percentile(cachedE2b, 99),
      baseline: { name: "the same cached build through POST /v1/templates/build", median: median(cachedNative), p99: percentile(cachedNative, 99) },
      goal: "≤ native + one 200 ms poll",
      note: "five SDK round trips (request, upload link, steps, status until ready, tail) against one native stream",
    },
  ];
}
