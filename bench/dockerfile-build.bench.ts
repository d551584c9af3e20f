// A Dockerfile build beside the declarative build of the same work, in the same run: cold (nothing cached), and
// with one line appended at the end (`ENV EXTRA=n`, everything before it cached). Both build FROM the base template.

import { request } from "undici";
import { median } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const ROUNDS = Number(process.env.KILN_BENCH_DOCKERFILE_ROUNDS ?? 3);

/** Three small RUN steps; `tag` makes a round's keys its own (cold). */
const commands = (tag: string) => [`echo ${tag} > /one`, "echo two > /two && ls / > /dev/null", "mkdir -p /srv/app && echo three > /srv/app/three"];

const declarative = (tag: string, extra?: string) => ({
  name: `bench-decl-${tag}`,
  steps: [...commands(tag).map((command) => ({ type: "run", command })), ...(extra ? [{ type: "env", envs: { EXTRA: extra } }] : [])],
});
const dockerfile = (tag: string, extra?: string) => ({
  name: `bench-df-${tag}`,
  build_backend: "buildkit",
  dockerfile: ["FROM local/base", ...commands(tag).map((c) => `RUN ${c}`), ...(extra ? [`ENV EXTRA=${extra}`] : [])].join("\n"),
});

/** Sends a build and resolves when it ends; the time to the terminal entry. */
async function timed(ctx: BenchContext, payload: unknown): Promise<number> {
  const t0 = performance.now();
  const res = await request(ctx.kiln.url + "/v1/templates/build", { method: "POST", headers: { authorization: `Bearer ${ctx.key}`, "content-type": "application/json" }, body: JSON.stringify(payload) });
  let text = "";
  for await (const chunk of res.body) text += chunk.toString();
  const took = performance.now() - t0;
  const last = /event: (\w+)\n(?![\s\S]*event: )/.exec(text)?.[1] ?? "?";
  if (last !== "end") throw new Error(`build ended ${last}: ${text.slice(-800)}`);
  return took;
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const run0 = Date.now().toString(36);
  const dCold: number[] = [];
  const fCold: number[] = [];
  const dEdit: number[] = [];
  const fEdit: number[] = [];
  // One Dockerfile build first: the builder's first use (its template image prepared) is not a round's cost.
  await timed(ctx, dockerfile(`${run0}-warm`));
  for (let i = 0; i < ROUNDS; i++) {
    const tag = `${run0}-${i}`;
    dCold.push(await timed(ctx, declarative(tag)));
    fCold.push(await timed(ctx, dockerfile(tag)));
    dEdit.push(await timed(ctx, declarative(tag, "1")));
    fEdit.push(await timed(ctx, dockerfile(tag, "1")));
  }
  return [
    { name: "Dockerfile build, cold (FROM local/base, 3 RUN)", unit: "ms", better: "lower", median: median(fCold), goal: "≤ 1.5× declarative", baseline: { name: "the same 3 steps declarative", median: median(dCold) } },
    { name: "Dockerfile build, one line appended (ENV at the end)", unit: "ms", better: "lower", median: median(fEdit), goal: "≤ 2 s", baseline: { name: "the same change declarative", median: median(dEdit) } },
  ];
}
