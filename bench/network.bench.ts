// Network throughput out of a machine: a 200 MB download by curl inside a machine from an HTTP server on the host's
// loopback (reached as host.kiln.internal, through the machine's slirp4netns and Kiln's egress filter), beside the
// same download by curl on the host itself, in the same run. A second Kiln with host access on serves the machines.

import { execFile, execFileSync } from "node:child_process";
import { promisify } from "node:util";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { api } from "./api.ts";
import { median } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { startTestKiln } from "../test/support/kiln.ts";

const SIZE_MB = Number(process.env.KILN_BENCH_DOWNLOAD_MB ?? 200);
const RUNS = 5;
const CHUNK = Buffer.alloc(1024 * 1024, 0x61);

/** Serves SIZE_MB of bytes at /blob, written a chunk at a time as the socket drains. */
async function blobServer() {
  const server = createServer((req, res) => {
    res.writeHead(200, { "content-type": "application/octet-stream", "content-length": SIZE_MB * CHUNK.length });
    let left = SIZE_MB;
    const pump = () => {
      while (left > 0) {
        left--;
        if (!res.write(CHUNK)) return void res.once("drain", pump);
      }
      res.end();
    };
    pump();
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  return { server, port: (server.address() as AddressInfo).port };
}

/** `curl -w` output "seconds bytes" → MB/s; fails when the download was short. */
function mbPerS(out: string): number {
  const [seconds, bytes] = out.trim().split(/\s+/).map(Number);
  if (bytes !== SIZE_MB * CHUNK.length) throw new Error(`short download: ${out}`);
  return bytes / 1e6 / seconds;
}

// Asynchronous: the blob server runs in this process, so a synchronous child would block the server it is reading.
const execAsync = promisify(execFile);
const CURL = ["-sS", "-o", "/dev/null", "-w", "%{time_total} %{size_download}"];

async function inMachines(runtime: "runc" | "runsc", key: string, port: number): Promise<number[]> {
  const kiln = await startTestKiln({ env: { KILN_LOG_LEVEL: "warn", KILN_OCI_RUNTIME: runtime, KILN_MACHINE_HOST_ACCESS: "1", KILN_WARM_POOL: "0" }, captureLogs: false });
  try {
    const call = (method: string, path: string, body?: unknown) => api(kiln.url, key, method, path, body);
    const m = await call("POST", "/v1/machines", { template: "local/base" });
    const rates: number[] = [];
    for (let i = 0; i < RUNS; i++) {
      const r = await call("POST", `/v1/machines/${m.id}/exec`, { cmd: "curl", args: [...CURL, `http://host.kiln.internal:${port}/blob`], timeout_s: 300 });
      if (r.exit_code !== 0) throw new Error(`curl in the machine failed: ${r.stderr}`);
      rates.push(mbPerS(r.stdout));
    }
    await call("DELETE", `/v1/machines/${m.id}`);
    return rates;
  } finally {
    await kiln.close();
  }
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const { server, port } = await blobServer();
  try {
    const host: number[] = [];
    for (let i = 0; i < RUNS; i++) host.push(mbPerS((await execAsync("curl", [...CURL, `http://127.0.0.1:${port}/blob`], { encoding: "utf8" })).stdout));
    const baseline = { name: "the same download by curl on the host", median: median(host) };
    const results: BenchResult[] = [
      {
        name: `download of ${SIZE_MB} MB from a host loopback server, curl in a machine (runc)`,
        unit: "MB/s",
        better: "higher",
        median: median(await inMachines("runc", ctx.key, port)),
        baseline,
        note: "machine → slirp4netns (user-mode TCP) → host socket in the machine's egress cgroup, filtered by nftables",
      },
    ];
    let runsc = true;
    try {
      execFileSync("runsc", ["--version"], { stdio: "ignore" });
    } catch {
      runsc = false;
    }
    if (runsc) {
      results.push({
        name: `download of ${SIZE_MB} MB from a host loopback server, curl in a machine (gVisor)`,
        unit: "MB/s",
        better: "higher",
        median: median(await inMachines("runsc", ctx.key, port)),
        baseline,
        note: "gVisor's netstack → slirp4netns → host socket, same egress filter",
      });
    }
    return results;
  } finally {
    server.close();
  }
}
