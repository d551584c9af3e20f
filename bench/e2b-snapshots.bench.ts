// E2B's snapshot and fork round trips as a user of the `e2b` SDK feels them — `sbx.createSnapshot()` answered, and
// `sbx.fork()` → the child's first `commands.run("true")` — each beside the same operation through Kiln's native API
// (`POST /v1/machines/{id}/snapshots`, `POST /v1/machines/{id}/fork {count: 1}` → the child's first exec) on the same
// parent machine, alternating, in the same run.

import { Sandbox } from "e2b";
import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { generateKeyIn } from "../src/keys/service.ts";

const ROUNDS = Number(process.env.KILN_BENCH_E2B_SNAPSHOT_ROUNDS ?? 8);
const BASH_TRUE = { cmd: "/bin/bash", args: ["-l", "-c", "true"] };

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const key = (await ctx.kiln.kiln.services.keys.create("bench-e2b-snapshots", generateKeyIn("e2b"))).key;
  const opts = { apiKey: key, apiUrl: ctx.kiln.url, sandboxUrl: ctx.kiln.url, requestTimeoutMs: 120_000 };
  const native = (method: string, path: string, body?: unknown) => api(ctx.kiln.url, ctx.key, method, path, body);

  // One parent, with some disk written, used by both sides.
  const parent = await Sandbox.create("base", { ...opts, timeoutMs: 600_000 });
  const parentId = (await native("GET", `/v1/machines/mch_${parent.sandboxId}`)).id as string;
  await parent.commands.run("head -c 20M /dev/urandom > /home/user/state.bin && sync");

  const sdkSnap: number[] = [];
  const nativeSnap: number[] = [];
  const sdkFork: number[] = [];
  const nativeFork: number[] = [];
  try {
    for (let i = 0; i < ROUNDS; i++) {
      let t0 = performance.now();
      const s = await parent.createSnapshot();
      sdkSnap.push(performance.now() - t0);
      await Sandbox.deleteSnapshot(s.snapshotId, opts);

      t0 = performance.now();
      const n = await native("POST", `/v1/machines/${parentId}/snapshots`, {});
      nativeSnap.push(performance.now() - t0);
      await native("DELETE", `/v1/snapshots/${n.id}`);

      t0 = performance.now();
      const [child] = await parent.fork({ timeoutMs: 120_000 });
      if (child instanceof Error) throw child;
      await child.commands.run("true");
      sdkFork.push(performance.now() - t0);
      await child.kill();

      t0 = performance.now();
      const forked = await native("POST", `/v1/machines/${parentId}/fork`, { count: 1 });
      await native("POST", `/v1/machines/${forked.machines[0].id}/exec`, BASH_TRUE);
      nativeFork.push(performance.now() - t0);
      await native("DELETE", `/v1/machines/${forked.machines[0].id}`);
    }
  } finally {
    await parent.kill();
  }

  return [
    {
      name: `E2B SDK: sbx.createSnapshot() of a running sandbox that wrote 20 MB (${ROUNDS} rounds)`,
      unit: "ms",
      better: "lower",
      median: median(sdkSnap),
      p99: percentile(sdkSnap, 99),
      baseline: { name: "POST /v1/machines/{id}/snapshots of the same machine", median: median(nativeSnap), p99: percentile(nativeSnap, 99) },
      goal: "≤ 1.2× native",
    },
    {
      name: `E2B SDK: sbx.fork() → the child's first commands.run("true") (${ROUNDS} rounds)`,
      unit: "ms",
      better: "lower",
      median: median(sdkFork),
      p99: percentile(sdkFork, 99),
      baseline: { name: "POST /v1/machines/{id}/fork {count: 1} → the child's first exec of bash -l -c true", median: median(nativeFork), p99: percentile(nativeFork, 99) },
      goal: "≤ 1.2× native",
      note: "the SDK's fork answers the sandbox, then connects its envd; the first run opens the layer's agent stream socket",
    },
  ];
}
