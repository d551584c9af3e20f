// Templates travel between hosts (src/hosts/layers/), measured in one run on one real PostgreSQL: the first machine
// of a freshly built template on a host that lacks its layers (it fetches the built layer from the host that built
// it, by content digest, checks the digest and unpacks it, then boots), beside the first machine of the same
// template on the host that built it. Each round builds a template of its own whose built layer holds `LAYER_MB` MiB
// of random bytes (the base template's layer does not travel: each host has its own). A warm-up template first, so
// the first fetch's connection set-up is not in the rounds.

import { median } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import type { TestKiln } from "../test/support/kiln.ts";
import { withCluster } from "./cluster.ts";

const ROUNDS = 3;
const LAYER_MB = 32;

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  return withCluster(2, {}, async ([builder, other]) => {
    const firstCreate = async (k: TestKiln, template: string) => {
      const t0 = performance.now();
      const m = await k.kiln.services.machines.create({ template });
      const ms = performance.now() - t0;
      await k.kiln.services.machines.destroy(m.id);
      return ms;
    };
    await build(ctx, builder, "travel-warmup", 1);
    await firstCreate(builder, "travel-warmup");
    const warmup = await firstCreate(other, "travel-warmup");
    const holding: number[] = [];
    const lacking: number[] = [];
    for (let i = 0; i < ROUNDS; i++) {
      const name = `travel-${i}`;
      await build(ctx, builder, name, LAYER_MB);
      holding.push(await firstCreate(builder, name));
      lacking.push(await firstCreate(other, name));
      process.stderr.write(`  (round ${i}) holding ${holding.at(-1)!.toFixed(0)} ms, lacking ${lacking.at(-1)!.toFixed(0)} ms\n`);
    }
    return [
      {
        name: `first create of a template on a host lacking its layers (fetches a ${LAYER_MB} MiB layer from a peer)`,
        unit: "ms",
        better: "lower",
        median: median(lacking),
        baseline: { name: "the first create of the same template on the host that built it", median: median(holding) },
        note: `${ROUNDS} templates, one round each; warm-up create on the lacking host ${(warmup / 1000).toFixed(1)} s`,
      },
    ];
  });
}

/** Builds a template whose one built layer holds `mb` MiB of random bytes, and waits for its end. */
async function build(ctx: BenchContext, k: TestKiln, name: string, mb: number): Promise<void> {
  const res = await fetch(`${k.url}/v1/templates/build`, {
    method: "POST",
    headers: { authorization: `Bearer ${ctx.key}`, "content-type": "application/json" },
    body: JSON.stringify({ name, steps: [{ type: "run", command: `head -c ${mb}M /dev/urandom > /opt/blob` }] }),
  });
  const text = await res.text();
  if (res.status !== 200 || !text.includes("event: end")) throw new Error(`template-travel bench: build ${name} did not end: ${text.slice(-500)}`);
}
