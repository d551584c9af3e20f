// `npm run bench`: starts one real Kiln (its own data dir, the shared base template), runs every bench/*.bench.ts
// in turn and writes docs/BENCHMARKS.md. Benchmarks are measurements, never pass/fail tests.

import { readdir } from "node:fs/promises";
import { join } from "node:path";
import { startTestKiln, TEST_KEY } from "../test/support/kiln.ts";
import type { TestKiln } from "../test/support/kiln.ts";
import { writeReport } from "./report.ts";
import type { BenchResult } from "./report.ts";

export interface BenchContext {
  kiln: TestKiln;
  key: string;
}

const only = process.argv.slice(2);
const here = import.meta.dirname;
// gVisor last: tearing its sandboxes down slows the host for a while, which would show in whatever ran next.
const files = (await readdir(here))
  .filter((f) => f.endsWith(".bench.ts") && (only.length === 0 || only.some((o) => f.startsWith(o))))
  .sort((a, b) => Number(a.startsWith("gvisor")) - Number(b.startsWith("gvisor")) || (a < b ? -1 : 1));

const kiln = await startTestKiln({ env: { KILN_LOG_LEVEL: "info" }, captureLogs: false });
const results: BenchResult[] = [];
try {
  for (const file of files) {
    process.stderr.write(`bench ${file} …\n`);
    const mod = (await import(join(here, file))) as { run(ctx: BenchContext): Promise<BenchResult[]> };
    const got = await mod.run({ kiln, key: TEST_KEY });
    for (const r of got) process.stderr.write(`  ${r.name}: ${r.median.toFixed(2)} ${r.unit}${r.baseline ? ` (baseline ${r.baseline.median.toFixed(2)})` : ""}\n`);
    results.push(...got);
  }
} finally {
  await kiln.close();
}
const NOTES = `## Reading these numbers

- Each benchmark runs against one real Kiln server (SQLite store, runc, the cached base template) in the same
  process as the benchmark, except the HTTP load generator, which runs in its own process.
- **Create, warm vs cold.** Kiln keeps \`KILN_WARM_POOL\` (default 2) machines of the base template booted, more
  after a burst (the pool follows the create rate up to \`KILN_WARM_POOL_MAX\`, by default what the memory floor
  allows; docs/hot-pools.md), so a row's pool depends on the rows before it: the fleet rows say what it held. A create
  of that shape takes one and the pool refills behind it, in a boot slot no create is waiting for. A burst larger
  than the pool pays the cold boot: the runtime's \`run\` (≈ the bare-runc baseline) plus the guest agent's Node
  start (≈ 35–40 ms of CPU here, most of it Node's own; see docs/snapshots.md).
- **podman** baselines (\`bench/fleet.bench.ts\`) run the base template's rootfs imported into podman once per run
  (\`podman run --rm IMG true\`, \`podman exec C true\`, as root with the ulimits this host accepts); where podman is
  not installed, bare \`runc run\` stands in and the row says so.
- **Exec** costs a process start as another user in its own process group inside the machine (≈ 4 ms on this
  host) plus two local HTTP hops.
- **gVisor** rows come from a second Kiln with \`KILN_OCI_RUNTIME=runsc\` (ptrace platform) started beside the
  first. A warm create is quick because the pool absorbs gVisor's boot (≈ 0.2 s of \`runsc run\` plus the agent's
  start under gVisor). An exec pays for process creation inside gVisor's kernel: each new address space is a new
  host stub process under ptrace, and a fork + exec of Node's child costs tens of milliseconds there (bash running
  \`/bin/true\` in a loop measured ≈ 30 ms each inside such a machine, ≈ 1 ms under runc).
- **Ready throughput** includes bearer-key verification, a request log line, and the readiness body; the baseline
  is a bare Fastify route with no logger. Both share the host's 2 cores with the load generator.
- **Stream throughput** is base64 in JSON text frames, as the protocol defines, through two WebSocket hops
  (agent → server → client); the baseline sends the same frames over one hop.
- **Webhooks** run on a second Kiln with \`KILN_WEBHOOK_ALLOW_PRIVATE=1\` and a receiver on loopback in the benchmark's
  own process. Lag is timed from the event's \`occurred_at\` (ms resolution) to the receiver's answer; throughput
  drains a backlog written through the outbox — each delivery claimed, signed, sent and recorded durably — beside as
  many plain fetch loops as the dispatcher allows requests in flight to one webhook (32).
`;
await writeReport(join(here, "..", "docs", "BENCHMARKS.md"), results, NOTES, { merge: only.length > 0 });
process.stderr.write("wrote docs/BENCHMARKS.md\n");
