// Authenticated GET /v1/ready throughput and latency, beside a bare Fastify hello-world measured in the same run.

import { execFile } from "node:child_process";
import { join } from "node:path";
import Fastify from "fastify";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

interface LoadResult {
  requests: { average: number };
  latency: { p50: number; p99: number };
  non2xx: number;
}

/** autocannon in its own process, so the load generator does not share the server's event loop. */
function load(url: string, headers: Record<string, string>): Promise<LoadResult> {
  const bin = join(import.meta.dirname, "..", "node_modules", "autocannon", "autocannon.js");
  const args = [bin, "--json", "-c", "32", "-d", "8", ...Object.entries(headers).flatMap(([k, v]) => ["-H", `${k}=${v}`]), url];
  return new Promise((resolve, reject) => {
    execFile(process.execPath, args, { maxBuffer: 64 * 1024 * 1024 }, (err, stdout) => (err ? reject(err) : resolve(JSON.parse(stdout) as LoadResult)));
  });
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const bare = Fastify();
  bare.get("/", async () => ({ hello: "world" }));
  const bareUrl = await bare.listen({ host: "127.0.0.1", port: 0 });
  try {
    await load(bareUrl, {}); // warm-up of the load generator and both servers' JITs
    const baseline = await load(bareUrl, {});
    await load(ctx.kiln.url + "/v1/ready", { authorization: `Bearer ${ctx.key}` }); // the same warm-up for Kiln
    const kiln = await load(ctx.kiln.url + "/v1/ready", { authorization: `Bearer ${ctx.key}` });
    if (kiln.non2xx > 0) throw new Error(`/v1/ready answered ${kiln.non2xx} non-2xx responses`);
    return [
      {
        name: "GET /v1/ready throughput (authenticated)",
        unit: "req/s",
        better: "higher",
        median: kiln.requests.average,
        baseline: { name: "bare Fastify hello-world", median: baseline.requests.average },
        goal: "≥ 0.6 × bare",
      },
      {
        name: "GET /v1/ready latency under load",
        unit: "ms",
        better: "lower",
        median: kiln.latency.p50,
        p99: kiln.latency.p99,
        baseline: { name: "bare Fastify hello-world", median: baseline.latency.p50, p99: baseline.latency.p99 },
      },
    ];
  } finally {
    await bare.close();
  }
}
