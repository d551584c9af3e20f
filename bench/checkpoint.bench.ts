// Machine create from a template whose start_cmd takes a while to get ready, under gVisor: restored from the build's
// checkpoint (start_cmd continues) beside the same template started at create (a machine without internet cannot
// take the checkpoint, so it starts start_cmd and waits for ready_cmd) — both on one runsc Kiln, in this run.

import { execFileSync } from "node:child_process";
import { request } from "undici";
import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { startTestKiln } from "../test/support/kiln.ts";

const CREATES = Math.min(Number(process.env.KILN_BENCH_CREATES ?? 50), 8);
/** A start command with a second of warm-up before it is ready, as a server loading its state would have. */
const START = "sleep 1; touch /tmp/ready; exec sleep infinity";

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  try {
    execFileSync("runsc", ["--version"], { stdio: "ignore" });
  } catch {
    process.stderr.write("  runsc is not installed: no checkpoint numbers\n");
    return [];
  }
  const gvisor = await startTestKiln({ env: { KILN_LOG_LEVEL: "warn", KILN_OCI_RUNTIME: "runsc", KILN_WARM_POOL: "0" }, captureLogs: false });
  try {
    const call = (method: string, path: string, body?: unknown) => api(gvisor.url, ctx.key, method, path, body);
    const res = await request(gvisor.url + "/v1/templates/build", {
      method: "POST",
      headers: { authorization: `Bearer ${ctx.key}`, "content-type": "application/json" },
      body: JSON.stringify({ name: "bench-warm-start", start_cmd: START, ready_cmd: "test -e /tmp/ready" }),
    });
    const log = await res.body.text();
    if (!/checkpointed under gVisor/.test(log)) throw new Error(`the build took no checkpoint: ${log.slice(-600)}`);
    const timeCreate = async (body: Record<string, unknown>) => {
      const t0 = performance.now();
      const m = await call("POST", "/v1/machines", body);
      await call("POST", `/v1/machines/${m.id}/exec`, { cmd: "test -e /tmp/ready" });
      const took = performance.now() - t0;
      await call("DELETE", `/v1/machines/${m.id}`);
      return took;
    };
    const restored: number[] = [];
    const started: number[] = [];
    for (let i = 0; i < CREATES; i++) {
      restored.push(await timeCreate({ template: "bench-warm-start" }));
      started.push(await timeCreate({ template: "bench-warm-start", internet: false }));
    }
    return [
      {
        name: `gVisor: create → first exec, start_cmd restored from the build's checkpoint (${CREATES} machines)`,
        unit: "ms",
        better: "lower",
        median: median(restored),
        p99: percentile(restored, 99),
        baseline: { name: "the same template, start_cmd started at create and waited for", median: median(started), p99: percentile(started, 99) },
        note: "start_cmd needs 1 s to get ready; the baseline machine has no internet, so it cannot take the checkpoint",
      },
    ];
  } finally {
    await gvisor.close();
  }
}
