// Machines under gVisor (KILN_OCI_RUNTIME=runsc): what the user-space kernel costs at create and at exec. A second
// Kiln on runsc runs beside the benchmark's runc one; baselines are a bare `runsc run /bin/true` on the same
// rootfs and the same exec on a runc machine, both measured in this run.

import { execFileSync } from "node:child_process";
import { api, bareRun } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { startTestKiln } from "../test/support/kiln.ts";

const CREATES = Math.min(Number(process.env.KILN_BENCH_CREATES ?? 50), 20);
const EXECS = 100;

async function execTimes(url: string, key: string, id: string): Promise<number[]> {
  for (let i = 0; i < 10; i++) await api(url, key, "POST", `/v1/machines/${id}/exec`, { cmd: "true", args: [] });
  const times: number[] = [];
  for (let i = 0; i < EXECS; i++) {
    const t0 = performance.now();
    await api(url, key, "POST", `/v1/machines/${id}/exec`, { cmd: "true", args: [] });
    times.push(performance.now() - t0);
  }
  return times;
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  try {
    execFileSync("runsc", ["--version"], { stdio: "ignore" });
  } catch {
    process.stderr.write("  runsc is not installed: no gVisor numbers\n");
    return [];
  }
  const gvisor = await startTestKiln({ env: { KILN_LOG_LEVEL: "warn", KILN_OCI_RUNTIME: "runsc" }, captureLogs: false });
  try {
    const call = (method: string, path: string, body?: unknown) => api(gvisor.url, ctx.key, method, path, body);
    const pool = gvisor.kiln.services.pool;
    const timeCreate = async (body: Record<string, unknown>) => {
      const t0 = performance.now();
      const m = await call("POST", "/v1/machines", body);
      await call("POST", `/v1/machines/${m.id}/exec`, { cmd: "true", args: [] });
      const took = performance.now() - t0;
      await call("DELETE", `/v1/machines/${m.id}`);
      return took;
    };
    const warm: number[] = [];
    for (let i = 0; i < CREATES; i++) {
      for (let w = 0; w < 1000 && pool.stats().ready < pool.stats().size; w++) await new Promise((r) => setTimeout(r, 10));
      warm.push(await timeCreate({ template: "local/base" }));
    }
    const cold: number[] = [];
    for (let i = 0; i < Math.min(CREATES, 10); i++) cold.push(await timeCreate({ template: "local/base", vcpus: 2 }));

    const base = await gvisor.kiln.services.templates.resolve("local/base");
    const bare = await bareRun("runsc", base.layers[base.layers.length - 1], Math.min(CREATES, 10));
    const bareBaseline = { name: "bare `runsc run /bin/true`, same rootfs", median: median(bare), p99: percentile(bare, 99) };

    const onGvisor = await call("POST", "/v1/machines", { template: "local/base" });
    const onRunc = await api(ctx.kiln.url, ctx.key, "POST", "/v1/machines", { template: "local/base" });
    const gvisorExec = await execTimes(gvisor.url, ctx.key, onGvisor.id);
    const runcExec = await execTimes(ctx.kiln.url, ctx.key, onRunc.id);
    await call("DELETE", `/v1/machines/${onGvisor.id}`);
    await api(ctx.kiln.url, ctx.key, "DELETE", `/v1/machines/${onRunc.id}`);

    return [
      {
        name: `gVisor: machine create → first exec answered, warm pool (${warm.length} machines)`,
        unit: "ms",
        better: "lower",
        median: median(warm),
        p99: percentile(warm, 99),
        baseline: bareBaseline,
        note: `pool of ${pool.stats().size}, refilled between creates`,
      },
      {
        name: `gVisor: machine create → first exec answered, cold boot (${cold.length} machines)`,
        unit: "ms",
        better: "lower",
        median: median(cold),
        p99: percentile(cold, 99),
        baseline: bareBaseline,
        note: "vcpus: 2, a shape the pool does not hold",
      },
      {
        name: "gVisor: exec round trip of `true` on a running machine",
        unit: "ms",
        better: "lower",
        median: median(gvisorExec),
        p99: percentile(gvisorExec, 99),
        baseline: { name: "the same exec on a runc machine", median: median(runcExec), p99: percentile(runcExec, 99) },
        note: "ptrace platform: every system call of the new process is trapped by gVisor's kernel",
      },
    ];
  } finally {
    await gvisor.close();
  }
}
