// Benchmark results and the docs/BENCHMARKS.md they are written to: each result is a median beside a baseline
// measured in the same run, and the ratio between them.

import { readFile, writeFile } from "node:fs/promises";
import { cpus, totalmem } from "node:os";

export interface BenchResult {
  name: string;
  unit: string;
  /** Lower is better for latencies and memory; higher for throughput. */
  better: "lower" | "higher";
  median: number;
  p99?: number;
  baseline?: { name: string; median: number; p99?: number };
  goal?: string;
  note?: string;
}

export function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

/** Times `fn` n times, one after another (ms each). */
export async function timed(n: number, fn: () => Promise<unknown>): Promise<number[]> {
  const times: number[] = [];
  for (let i = 0; i < n; i++) {
    const t0 = performance.now();
    await fn();
    times.push(performance.now() - t0);
  }
  return times;
}

export function percentile(xs: number[], p: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.ceil((p / 100) * s.length) - 1)];
}

function fmt(n: number | undefined): string {
  if (n === undefined) return "–";
  if (Math.abs(n) >= 100) return n.toFixed(0);
  if (Math.abs(n) >= 10) return n.toFixed(1);
  return n.toFixed(2);
}

/** Kiln ÷ baseline for throughput, baseline ÷ Kiln for latency: ≥ 1 always means "as good as the baseline or better". */
export function ratio(r: BenchResult): number | undefined {
  if (!r.baseline || r.baseline.median === 0 || r.median === 0) return undefined;
  return r.better === "higher" ? r.median / r.baseline.median : r.baseline.median / r.median;
}

const HEADER = "| benchmark | kiln median | kiln p99 | baseline | baseline median | ratio | goal | note | measured |";

/** The table rows of an earlier report, by benchmark name; a row from before the `measured` column gets `when`. */
async function earlierRows(path: string): Promise<Map<string, string>> {
  const text = await readFile(path, "utf8").catch(() => "");
  const when = /Measured by `npm run bench` on (\S+?)[ —]/.exec(text)?.[1]?.slice(0, 16).replace("T", " ") ?? "earlier";
  const rows = new Map<string, string>();
  for (const line of text.split("\n")) {
    if (!line.startsWith("| ") || line.startsWith("| benchmark |")) continue;
    const cells = line.trim().slice(1, -1).split("|");
    rows.set(cells[0].trim(), cells.length === 8 ? `${line.trimEnd()} ${when} |` : line);
  }
  return rows;
}

/**
 * Writes the report. A run of some benchmarks (`npm run bench -- <prefix>`) replaces their rows and keeps the others
 * from the file as it was; every row says when it was measured.
 */
export async function writeReport(path: string, results: BenchResult[], notes = "", opts: { merge?: boolean } = {}) {
  const when = new Date().toISOString();
  const stamp = when.slice(0, 16).replace("T", " ");
  const rows = opts.merge ? await earlierRows(path) : new Map<string, string>();
  for (const r of results) {
    const q = ratio(r);
    rows.set(
      r.name,
      `| ${r.name} | ${fmt(r.median)} ${r.unit} | ${r.p99 === undefined ? "–" : fmt(r.p99) + " " + r.unit} | ${r.baseline?.name ?? "–"} | ${r.baseline ? fmt(r.baseline.median) + " " + r.unit : "–"} | ${q === undefined ? "–" : q.toFixed(2)} | ${r.goal ?? "–"} | ${r.note ?? ""} | ${stamp} |`,
    );
  }
  const lines = [
    "# Benchmarks",
    "",
    `Measured by \`npm run bench\` on ${when} — ${cpus().length} cores (${cpus()[0]?.model ?? "?"}), ${(totalmem() / 2 ** 30).toFixed(0)} GiB, Node ${process.version}.`,
    "Every number is a median over the run (p99 where shown). **ratio** compares Kiln with the baseline measured in the same run,",
    "oriented so that 1.0 means as good as the baseline and higher is better (throughput: kiln ÷ baseline; latency: baseline ÷ kiln).",
    opts.merge ? "Rows of benchmarks that did not run this time are kept from earlier runs: `measured` says when each row was taken." : "",
    "",
    HEADER,
    "|---|---|---|---|---|---|---|---|---|",
    ...rows.values(),
    "",
    notes,
  ];
  await writeFile(path, lines.join("\n"));
}
