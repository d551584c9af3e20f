// Machine file watches and metrics as a user feels them: a file made in the machine → its file_event on the
// machine WebSocket (beside the same command's exec.exit on that socket, in the same run), and a metrics call
// (beside GET /v1/machines/{id}).

import { WebSocket } from "ws";
import { api } from "./api.ts";
import { collectFrames } from "../test/support/frames.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const EVENTS = 200;
const CALLS = 200;

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const native = (method: string, path: string, body?: unknown) => api(ctx.kiln.url, ctx.key, method, path, body);
  const m = await native("POST", "/v1/machines", { template: "local/base" });
  const ws = new WebSocket(`${ctx.kiln.url.replace("http", "ws")}/v1/machines/${m.id}/ws`, { headers: { authorization: `Bearer ${ctx.key}` } });
  const frames = collectFrames(ws);
  await new Promise<void>((resolve, reject) => ws.once("open", () => resolve()).once("error", reject));
  // Frames that arrive before they are waited for are kept (an exit can come in the same read as its start).
  const next = (pred: (f: any) => boolean) => frames.next(pred, 30_000);

  await native("POST", `/v1/machines/${m.id}/exec`, { cmd: "mkdir -p /workspace/bench" });
  const started = next((f) => f.type === "file_watch.started");
  ws.send(JSON.stringify({ type: "file_watch", request_id: "b", path: "/workspace/bench", recursive: true }));
  const { watch_id } = await started;

  const toEvent: number[] = [];
  const toExit: number[] = [];
  for (let i = 0; i < EVENTS + 10; i++) {
    const path = `/workspace/bench/f${i}`;
    const t0 = performance.now();
    const event = next((f) => f.type === "file_event" && f.watch_id === watch_id && f.path === path && f.event === "create").then(() => performance.now() - t0);
    const exStarted = next((f) => f.type === "exec.started" && f.request_id === `e${i}`);
    ws.send(JSON.stringify({ type: "exec.start", request_id: `e${i}`, cmd: "touch", args: [path] }));
    const { pid } = await exStarted;
    const exit = await next((f) => f.type === "exec.exit" && f.pid === pid).then(() => performance.now() - t0);
    const ev = await event;
    if (i >= 10) (toEvent.push(ev), toExit.push(exit));
  }
  ws.close();

  const metrics: number[] = [];
  const get: number[] = [];
  await native("GET", `/v1/machines/${m.id}/metrics`);
  for (let i = 0; i < CALLS; i++) {
    let t0 = performance.now();
    await native("GET", `/v1/machines/${m.id}/metrics`);
    metrics.push(performance.now() - t0);
    t0 = performance.now();
    await native("GET", `/v1/machines/${m.id}`);
    get.push(performance.now() - t0);
  }
  await native("DELETE", `/v1/machines/${m.id}`);

  return [
    {
      name: `Machine file watch: exec.start of touch → its file_event create (${EVENTS} files)`,
      unit: "ms",
      better: "lower",
      median: median(toEvent),
      p99: percentile(toEvent, 99),
      baseline: { name: "the same command's exec.exit on the same socket", median: median(toExit), p99: percentile(toExit, 99) },
      goal: "≤ 1.2× the exit",
      note: "inotify in the guest agent, relayed over the machine WebSocket",
    },
    {
      name: `GET /v1/machines/{id}/metrics (${CALLS} calls, back to back)`,
      unit: "ms",
      better: "lower",
      median: median(metrics),
      p99: percentile(metrics, 99),
      baseline: { name: "GET /v1/machines/{id}", median: median(get), p99: percentile(get, 99) },
      goal: "≤ 3× the record",
      note: "cgroup files and statfs; CPU share measured since an earlier call (no 200 ms sample after the first)",
    },
  ];
}
