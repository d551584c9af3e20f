// Machine WebSocket latencies and throughput: PTY keystroke echo round trip and exec stdout MB/s, each beside
// the same work over a plain local `ws` echo/stream server measured in the same run.

import { WebSocket, WebSocketServer } from "ws";
import { request } from "undici";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const KEYSTROKES = 300;
const STREAM_BYTES = 256 * 1024 * 1024;

function frames(ws: WebSocket) {
  const queue: any[] = [];
  let wake: (() => void) | undefined;
  ws.on("message", (d) => {
    queue.push(JSON.parse(d.toString()));
    wake?.();
  });
  return async function next(pred: (f: any) => boolean): Promise<any> {
    for (;;) {
      const i = queue.findIndex(pred);
      if (i >= 0) return queue.splice(i, 1)[0];
      queue.length = 0;
      await new Promise<void>((r) => (wake = r));
    }
  };
}

function open(url: string, headers: Record<string, string> = {}): Promise<WebSocket> {
  const ws = new WebSocket(url, { headers });
  return new Promise((resolve, reject) => {
    ws.once("open", () => resolve(ws));
    ws.once("error", reject);
  });
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const create = await request(ctx.kiln.url + "/v1/machines", {
    method: "POST",
    headers: { authorization: `Bearer ${ctx.key}`, "content-type": "application/json" },
    body: JSON.stringify({}),
  });
  const machine = (await create.body.json()) as { id: string };
  const wsUrl = `${ctx.kiln.url.replace("http", "ws")}/v1/machines/${machine.id}/ws`;
  const auth = { authorization: `Bearer ${ctx.key}` };

  // Baseline: a plain ws server on loopback that echoes frames and streams a byte count in 64 KiB frames.
  const plain = new WebSocketServer({ host: "127.0.0.1", port: 0 });
  plain.on("connection", (s) =>
    s.on("message", (d) => {
      const f = JSON.parse(d.toString());
      if (f.type === "echo") s.send(JSON.stringify({ type: "echo", data_base64: f.data_base64 }));
      if (f.type === "stream") {
        const chunk = Buffer.alloc(65536).toString("base64");
        let sent = 0;
        const pump = () => {
          while (sent < f.bytes && s.bufferedAmount < 4 * 1024 * 1024) {
            s.send(JSON.stringify({ type: "data", data_base64: chunk }));
            sent += 65536;
          }
          if (sent < f.bytes) setTimeout(pump, 1);
          else s.send(JSON.stringify({ type: "done" }));
        };
        pump();
      }
    }),
  );
  await new Promise((r) => plain.once("listening", r));
  const plainUrl = `ws://127.0.0.1:${(plain.address() as { port: number }).port}`;

  try {
    // PTY echo: one key in, its echo out (the PTY's line discipline echoes it).
    const ws = await open(wsUrl, auth);
    const next = frames(ws);
    ws.send(JSON.stringify({ type: "pty.start", request_id: "b", cmd: "/bin/cat", cols: 80, rows: 24 }));
    const s = await next((f) => f.type === "pty.started");
    const ptyTimes: number[] = [];
    for (let i = 0; i < KEYSTROKES + 20; i++) {
      const key = String.fromCharCode(97 + (i % 26));
      const t0 = performance.now();
      ws.send(JSON.stringify({ type: "pty.input", session_id: s.session_id, data_base64: Buffer.from(key).toString("base64") }));
      await next((f) => f.type === "pty.output" && Buffer.from(f.data_base64, "base64").toString().includes(key));
      if (i >= 20) ptyTimes.push(performance.now() - t0);
    }
    ws.send(JSON.stringify({ type: "pty.kill", session_id: s.session_id }));
    ws.close();

    const pws = await open(plainUrl);
    const pnext = frames(pws);
    const plainTimes: number[] = [];
    for (let i = 0; i < KEYSTROKES + 20; i++) {
      const t0 = performance.now();
      pws.send(JSON.stringify({ type: "echo", data_base64: "YQ==" }));
      await pnext((f) => f.type === "echo");
      if (i >= 20) plainTimes.push(performance.now() - t0);
    }

    // Exec stdout throughput.
    const ews = await open(wsUrl, auth);
    const enext = frames(ews);
    const t0 = performance.now();
    ews.send(JSON.stringify({ type: "exec.start", request_id: "t", cmd: `head -c ${STREAM_BYTES} /dev/zero` }));
    let got = 0;
    for (;;) {
      const f = await enext((x) => x.type === "exec.stdout" || x.type === "exec.exit");
      if (f.type === "exec.exit") break;
      got += Buffer.from(f.data_base64, "base64").length;
    }
    const execMBs = got / 2 ** 20 / ((performance.now() - t0) / 1000);
    ews.close();

    const t1 = performance.now();
    pws.send(JSON.stringify({ type: "stream", bytes: STREAM_BYTES }));
    let pgot = 0;
    for (;;) {
      const f = await pnext((x) => x.type === "data" || x.type === "done");
      if (f.type === "done") break;
      pgot += Buffer.from(f.data_base64, "base64").length;
    }
    const plainMBs = pgot / 2 ** 20 / ((performance.now() - t1) / 1000);
    pws.close();

    return [
      {
        name: "PTY keystroke echo round trip",
        unit: "ms",
        better: "lower",
        median: median(ptyTimes),
        p99: percentile(ptyTimes, 99),
        baseline: { name: "plain local ws echo server", median: median(plainTimes), p99: percentile(plainTimes, 99) },
        goal: "p50 ≤ 2 ms",
      },
      {
        name: "exec stdout throughput over the machine WebSocket",
        unit: "MB/s",
        better: "higher",
        median: execMBs,
        baseline: { name: "plain local ws stream of base64 64 KiB frames", median: plainMBs },
        goal: "≥ 200 MB/s",
      },
    ];
  } finally {
    plain.close();
    await request(ctx.kiln.url + `/v1/machines/${machine.id}`, { method: "DELETE", headers: auth }).then((r) => r.body.dump());
  }
}
