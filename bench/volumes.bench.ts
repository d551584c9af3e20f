// Volume watch: latency from a write inside a machine to its file_event frame, and create events per second
// delivered without loss, each beside a raw `inotifywait` on the same host mount receiving the same writes.

import { spawn } from "node:child_process";
import { join } from "node:path";
import { WebSocket } from "ws";
import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const WRITES = 200;
const BURST = 20_000;

/** Wall-clock milliseconds with sub-millisecond precision: comparable with `date +%s%N` inside a machine (one kernel clock). */
const nowMs = () => performance.timeOrigin + performance.now();

function open(url: string, headers: Record<string, string>): Promise<WebSocket> {
  const ws = new WebSocket(url, { headers });
  return new Promise((resolve, reject) => {
    ws.once("open", () => resolve(ws));
    ws.once("error", reject);
  });
}

/** Raw inotifywait on the same directory: calls `onPath` with each created path (relative to `dir`) as it arrives. */
function rawInotify(dir: string, onPath: (path: string) => void): Promise<{ stop(): void }> {
  const child = spawn("inotifywait", ["-m", "-r", "-P", "--no-newline", "--format", "%e %w%f%0", "-e", "create", dir], { stdio: ["ignore", "pipe", "pipe"] });
  let pending = "";
  child.stdout.setEncoding("utf8");
  child.stdout.on("data", (text: string) => {
    const parts = (pending + text).split("\0");
    pending = parts.pop() ?? "";
    for (const p of parts) onPath(p.slice(p.indexOf(" ") + 1).slice(dir.length));
  });
  return new Promise((resolve) => {
    let err = "";
    child.stderr.on("data", (d) => {
      err += d;
      if (err.includes("Watches established.")) resolve({ stop: () => child.kill() });
    });
  });
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const { url } = ctx.kiln;
  const auth = { authorization: `Bearer ${ctx.key}` };
  const volume = await api(url, ctx.key, "POST", "/v1/volumes", { name: "bench", size_mb: 512 });
  const machine = await api(url, ctx.key, "POST", "/v1/machines", { volumes: [{ volume_id: volume.id, path: "/data" }] });
  const mount = join(ctx.kiln.dataDir, "volumes", volume.id, "mnt");
  const sockets: WebSocket[] = [];
  let raw: { stop(): void } | undefined;
  try {
    await api(url, ctx.key, "POST", `/v1/volumes/${volume.id}/files/mkdir`, { path: "/lat" });
    await api(url, ctx.key, "POST", `/v1/volumes/${volume.id}/files/mkdir`, { path: "/burst" });

    // Both listeners on the same writes: Kiln's socket and a bare inotifywait on the host mount.
    const kilnArrivals = new Map<string, number>();
    const rawArrivals = new Map<string, number>();
    let resyncs = 0;
    let onKiln: (() => void) | undefined;
    const ws = await open(`${url.replace("http", "ws")}/v1/volumes/${volume.id}/ws`, auth);
    sockets.push(ws);
    ws.on("message", (d) => {
      const f = JSON.parse(d.toString());
      if (f.type === "file_event" && f.event === "create") kilnArrivals.set(f.path, nowMs());
      if (f.type === "resync_required") resyncs++;
      onKiln?.();
    });
    ws.send(JSON.stringify({ type: "file_watch", request_id: "b", path: "/", recursive: true }));
    await new Promise<void>((resolve) => ws.once("message", () => resolve()));
    raw = await rawInotify(mount, (p) => rawArrivals.set(p, nowMs()));

    // A writer in the machine: on each line, note the clock, then create a file holding that time.
    const exec = await open(`${url.replace("http", "ws")}/v1/machines/${machine.id}/ws`, auth);
    sockets.push(exec);
    const execFrames: any[] = [];
    exec.on("message", (d) => execFrames.push(JSON.parse(d.toString())));
    exec.send(JSON.stringify({ type: "exec.start", request_id: "w", cmd: 'while read n; do t=$(date +%s%N); echo $t > /data/lat/f$n; echo $t; done', stdin: true }));
    while (!execFrames.some((f) => f.type === "exec.started")) await new Promise((r) => setTimeout(r, 5));
    const pid = execFrames.find((f) => f.type === "exec.started").pid;
    const writtenAt = new Map<string, number>();
    for (let i = 0; i < WRITES; i++) {
      const path = `/lat/f${i}`;
      const seen = new Promise<void>((resolve) => {
        onKiln = () => kilnArrivals.has(path) && resolve();
      });
      exec.send(JSON.stringify({ type: "exec.stdin", pid, data: `${i}\n` }));
      await seen;
      // Give the raw listener its line too before the next write.
      while (!rawArrivals.has(path)) await new Promise((r) => setTimeout(r, 1));
    }
    exec.send(JSON.stringify({ type: "exec.stdin", pid, data: "", eof: true }));
    // The machine's clock readings (nanoseconds), in the order written.
    await new Promise((r) => setTimeout(r, 200));
    const stamps = execFrames
      .filter((f) => f.type === "exec.stdout")
      .map((f) => Buffer.from(f.data_base64, "base64").toString())
      .join("")
      .trim()
      .split("\n")
      .map((s) => Number(s) / 1e6);
    stamps.forEach((t, i) => writtenAt.set(`/lat/f${i}`, t));
    const kilnLat: number[] = [];
    const rawLat: number[] = [];
    for (const [path, t] of writtenAt) {
      kilnLat.push(kilnArrivals.get(path)! - t);
      rawLat.push(rawArrivals.get(path)! - t);
    }

    // Sustained rate: a burst of creates from the machine, every one expected on both listeners.
    const before = resyncs;
    const t0 = nowMs();
    const burst = api(url, ctx.key, "POST", `/v1/machines/${machine.id}/exec`, { cmd: `cd /data/burst && i=0; while [ $i -lt ${BURST} ]; do : > f$i; i=$((i+1)); done`, timeout_s: 600 });
    const deadline = Date.now() + 300_000;
    const count = (m: Map<string, number>) => [...m.keys()].filter((p) => p.startsWith("/burst/")).length;
    await burst;
    while ((count(kilnArrivals) < BURST || count(rawArrivals) < BURST) && resyncs === before && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    const lastOf = (m: Map<string, number>) => Math.max(...[...m].filter(([p]) => p.startsWith("/burst/")).map(([, t]) => t));
    const kilnRate = count(kilnArrivals) / ((lastOf(kilnArrivals) - t0) / 1000);
    const rawRate = count(rawArrivals) / ((lastOf(rawArrivals) - t0) / 1000);
    const lost = BURST - count(kilnArrivals);

    return [
      {
        name: "volume watch: write in a machine → file_event frame",
        unit: "ms",
        better: "lower",
        median: median(kilnLat),
        p99: percentile(kilnLat, 99),
        baseline: { name: "raw inotifywait on the host mount, same writes", median: median(rawLat), p99: percentile(rawLat, 99) },
        goal: "p50 ≤ 10 ms",
      },
      {
        name: `volume watch: create events/s, a burst of ${BURST} from a machine`,
        unit: "events/s",
        better: "higher",
        median: kilnRate,
        baseline: { name: "raw inotifywait on the host mount, same burst", median: rawRate },
        note: lost === 0 && resyncs === before ? "no event lost, no resync" : `${lost} events not delivered, ${resyncs - before} resync_required`,
      },
    ];
  } finally {
    raw?.stop();
    for (const s of sockets) s.close();
    await api(url, ctx.key, "DELETE", `/v1/machines/${machine.id}`).catch(() => undefined);
    await api(url, ctx.key, "DELETE", `/v1/volumes/${volume.id}`).catch(() => undefined);
  }
}
