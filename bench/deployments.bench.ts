// Agent deployments: requests/s and p50 latency through a service's public URL (the edge proxy) beside the same
// service reached through the agent's port tunnel by a bare byte forwarder, and restart-to-ready time beside the
// time the restarted process itself takes to accept connections.

import { execFile } from "node:child_process";
import { createServer } from "node:net";
import type { AddressInfo } from "node:net";
import { join } from "node:path";
import { request } from "undici";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { GUEST_LOADER } from "../src/runtime/guest-runtime.ts";

interface LoadResult {
  requests: { average: number };
  latency: { p50: number; p99: number };
  non2xx: number;
  errors: number;
}

function load(url: string): Promise<LoadResult> {
  const bin = join(import.meta.dirname, "..", "node_modules", "autocannon", "autocannon.js");
  return new Promise((resolve, reject) => {
    execFile(process.execPath, [bin, "--json", "-c", "32", "-d", "5", url], { maxBuffer: 64 * 1024 * 1024 }, (err, stdout) => (err ? reject(err) : resolve(JSON.parse(stdout) as LoadResult)));
  });
}

/** A small keep-alive HTTP server run with the Node Kiln injects into every machine. */
const SERVER = "require('http').createServer((q, s) => s.end('ok')).listen(8080)";
const COMMAND = `exec /opt/kiln/lib/${GUEST_LOADER} --library-path /opt/kiln/lib /opt/kiln/bin/node -e "${SERVER}"`;

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const api = async (method: string, path: string, body?: unknown) => {
    const res = await request(ctx.kiln.url + path, {
      method: method as "GET",
      headers: { authorization: `Bearer ${ctx.key}`, ...(body ? { "content-type": "application/json" } : {}) },
      body: body ? JSON.stringify(body) : undefined,
    });
    const json = (await res.body.json()) as any;
    if (res.statusCode >= 400) throw new Error(`${method} ${path}: ${JSON.stringify(json)}`);
    return json;
  };
  const waitReady = async (dep: string, svc: string, notPid?: number) => {
    for (;;) {
      const s = await api("GET", `/v1/agent-deployments/${dep}/services/${svc}`);
      if (s.status === "ready" && s.process_id !== notPid) return s;
      if (s.status === "failed") throw new Error(`the bench service failed: ${s.failure_reason}`);
      await new Promise((r) => setTimeout(r, 5));
    }
  };

  const dep = await api("POST", "/v1/agent-deployments", { name: "bench", template: "local/base", command: COMMAND, port: 8080, readiness: { interval_s: 0.1, timeout_s: 1 } });
  try {
    const [first] = (await api("GET", `/v1/agent-deployments/${dep.id}/services`)).services;
    const svc = await waitReady(dep.id, first.id);
    const { agent } = await ctx.kiln.kiln.services.machines.agentOf(svc.machine_id);

    // Baseline: a bare forwarder that splices each client connection onto its own tunnel to the service.
    const direct = createServer((client) => {
      agent.connectPort(8080).then(
        (tunnel) => {
          client.pipe(tunnel).pipe(client);
          client.on("error", () => tunnel.destroy());
          tunnel.on("error", () => client.destroy());
          client.on("close", () => tunnel.destroy());
          tunnel.on("close", () => client.destroy());
        },
        () => client.destroy(),
      );
    });
    await new Promise<void>((r) => direct.listen(0, "127.0.0.1", r));
    const directUrl = `http://127.0.0.1:${(direct.address() as AddressInfo).port}/`;
    // Direct and edge runs alternate, three of each, and each side reports its median run: this host's load moves
    // a lot between runs, and alternating keeps both sides exposed to the same drift.
    const bareRuns: LoadResult[] = [];
    const edgeRuns: LoadResult[] = [];
    try {
      await load(directUrl); // warm-up of the load generator, the tunnel and the service
      await load(svc.public_url);
      for (let i = 0; i < 3; i++) {
        bareRuns.push(await load(directUrl));
        edgeRuns.push(await load(svc.public_url));
      }
    } finally {
      direct.close();
    }
    const byRate = (a: LoadResult, b: LoadResult) => a.requests.average - b.requests.average;
    const bare = bareRuns.sort(byRate)[1];
    const edge = edgeRuns.sort(byRate)[1];
    for (const r of edgeRuns) if (r.non2xx > 0 || r.errors > 0) throw new Error(`the public URL answered ${r.non2xx} non-2xx responses and ${r.errors} errors`);

    // Restart to ready, through the API (probe every 0.1 s), beside the process's own start-to-listening time.
    const viaApi: number[] = [];
    const processOnly: number[] = [];
    let pid = svc.process_id as number;
    for (let i = 0; i < 7; i++) {
      const t0 = performance.now();
      const r = await api("POST", `/v1/agent-deployments/${dep.id}/services/${svc.id}/restart`, { reason: "bench" });
      const ready = await waitReady(dep.id, svc.id, pid);
      viaApi.push(performance.now() - t0);
      pid = ready.process_id;
      // The floor: restart through the agent and poll the port directly every 2 ms.
      const t1 = performance.now();
      await agent.restartService(svc.id);
      for (;;) {
        const s = await agent.connectPort(8080).catch(() => undefined);
        if (s) {
          s.destroy();
          break;
        }
        await new Promise((res) => setTimeout(res, 2));
      }
      processOnly.push(performance.now() - t1);
      pid = (await waitReady(dep.id, svc.id, r.process_id)).process_id;
    }

    return [
      {
        name: "Public URL throughput (edge proxy → agent tunnel → service)",
        unit: "req/s",
        better: "higher",
        median: edge.requests.average,
        baseline: { name: "bare forwarder onto the agent tunnel", median: bare.requests.average },
        goal: "≥ 0.7 × direct",
      },
      {
        name: "Public URL latency under load (p50)",
        unit: "ms",
        better: "lower",
        median: edge.latency.p50,
        p99: edge.latency.p99,
        baseline: { name: "bare forwarder onto the agent tunnel", median: bare.latency.p50, p99: bare.latency.p99 },
      },
      {
        name: "Service restart to ready (API, probe every 0.1 s)",
        unit: "ms",
        better: "lower",
        median: median(viaApi),
        p99: percentile(viaApi, 99),
        baseline: { name: "agent restart until the port accepts (polled every 2 ms)", median: median(processOnly), p99: percentile(processOnly, 99) },
      },
    ];
  } finally {
    await api("DELETE", `/v1/agent-deployments/${dep.id}`).catch(() => undefined);
  }
}
