// Many hosts: an exec forwarded through a server that does not run the machine, beside the same exec sent straight
// to the server that runs it, measured in the same run. Two Kiln servers share one real PostgreSQL (each its own
// data dir and host); the machine runs on the second, and execs alternate between the two front doors.
// Both servers run in this process (as the gVisor bench's second server does), so the forwarding hop's CPU shares
// the event loop with the owner's: a cluster on separate hosts pays the network instead.

import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { startTestKiln } from "../test/support/kiln.ts";
import { startPostgres } from "../test/support/postgres.ts";

const EXECS = 200;

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const db = await startPostgres();
  const env = { KILN_LOG_LEVEL: "warn", KILN_DATABASE_URL: db.url, KILN_WARM_POOL: "0" };
  const front = await startTestKiln({ env, captureLogs: false });
  const owner = await startTestKiln({ env, captureLogs: false });
  try {
    // Made on the owner itself (no placement), so the machine is known to run there.
    const machine = await owner.kiln.services.machines.create({});
    const exec = (url: string) => api(url, ctx.key, "POST", `/v1/machines/${machine.id}/exec`, { cmd: "true", args: [] });
    for (let i = 0; i < 20; i++) {
      await exec(owner.url);
      await exec(front.url);
    }
    const direct: number[] = [];
    const forwarded: number[] = [];
    for (let i = 0; i < EXECS; i++) {
      let t0 = performance.now();
      await exec(owner.url);
      direct.push(performance.now() - t0);
      t0 = performance.now();
      await exec(front.url);
      forwarded.push(performance.now() - t0);
    }
    await owner.kiln.services.machines.destroy(machine.id);
    return [
      {
        name: "exec forwarded through another host's server",
        unit: "ms",
        better: "lower",
        median: median(forwarded),
        p99: percentile(forwarded, 99),
        baseline: { name: "the same exec sent to the owning server", median: median(direct), p99: percentile(direct, 99) },
        goal: "≤ 1.5 × direct, or + ≤ 1 ms",
      },
    ];
  } finally {
    await front.close();
    await owner.close();
    await db.stop();
  }
}
