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
const files = (await readdir(here)).filter((f) => f.endsWith(".bench.ts") && (only.length === 0 || only.some((o) => f.startsWith(o)))).sort();

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
await writeReport(join(here, "..", "docs", "BENCHMARKS.md"), results);
process.stderr.write("wrote docs/BENCHMARKS.md\n");
