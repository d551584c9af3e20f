// files/list in pages: an ordinary directory (one answer) beside `ls -la` of it run through exec, and a page of
// 10,000 from a directory of 100,000 entries beside a bare scan of that directory in the machine (`ls -f | wc -l`),
// the floor any page of it pays (each page streams the directory's names once; see docs/security/machines.md).

import { api } from "./api.ts";
import { median } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const RUNS = 15;
const ENTRIES = 100_000;

async function timed(n: number, fn: () => Promise<unknown>): Promise<number[]> {
  const out: number[] = [];
  for (let i = 0; i < n; i++) {
    const t0 = performance.now();
    await fn();
    out.push(performance.now() - t0);
  }
  return out;
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const { url } = ctx.kiln;
  const call = (method: string, path: string, body?: unknown) => api(url, ctx.key, method, path, body);
  const machine = await call("POST", "/v1/machines", { internet: false });
  try {
    const make = `import os
os.makedirs("/tmp/big", exist_ok=True)
for i in range(${ENTRIES}):
    open("/tmp/big/f%06d" % i, "w").close()`;
    await call("POST", `/v1/machines/${machine.id}/exec`, { cmd: "python3", args: ["-c", make], user: "root", timeout_s: 300 });
    // Warm both paths once.
    await call("GET", `/v1/machines/${machine.id}/files/list?path=/etc`);
    await call("POST", `/v1/machines/${machine.id}/exec`, { cmd: "ls -la /etc" });

    const small = await timed(RUNS, () => call("GET", `/v1/machines/${machine.id}/files/list?path=/etc`));
    const smallLs = await timed(RUNS, () => call("POST", `/v1/machines/${machine.id}/exec`, { cmd: "ls -la /etc" }));
    const first = await call("GET", `/v1/machines/${machine.id}/files/list?path=/tmp/big&limit=10000`);
    const cursor = encodeURIComponent(first.next_cursor);
    const page = await timed(RUNS, () => call("GET", `/v1/machines/${machine.id}/files/list?path=/tmp/big&limit=10000&cursor=${cursor}`));
    const scan = await timed(RUNS, () => call("POST", `/v1/machines/${machine.id}/exec`, { cmd: "ls -f /tmp/big | wc -l" }));
    return [
      {
        name: "files/list of /etc (one answer)",
        unit: "ms",
        better: "lower",
        median: median(small),
        baseline: { name: "exec `ls -la /etc`", median: median(smallLs) },
      },
      {
        name: `files/list page of 10,000 from ${ENTRIES.toLocaleString("en")} entries`,
        unit: "ms",
        better: "lower",
        median: median(page),
        baseline: { name: "exec `ls -f | wc -l` of the same directory", median: median(scan) },
        note: "a page streams every name of the directory once and lstat's the 10,000 it answers",
      },
    ];
  } finally {
    await call("DELETE", `/v1/machines/${machine.id}`);
  }
}
