// A test-side reader of JSON WebSocket frames: keeps what arrives, and waits for the next frame that matches.
// Shared by the agent's own stream tests and the machine WebSocket tests.

import type { WebSocket } from "ws";

export function collectFrames(ws: WebSocket) {
  const frames: any[] = [];
  const waiters: { pred: (f: any) => boolean; resolve: (f: any) => void }[] = [];
  ws.on("message", (data) => {
    const f = JSON.parse(data.toString());
    const w = waiters.find((x) => x.pred(f));
    if (w) {
      waiters.splice(waiters.indexOf(w), 1);
      w.resolve(f);
    } else frames.push(f);
  });
  const reader = {
    frames,
    send: (f: unknown) => ws.send(typeof f === "string" ? f : JSON.stringify(f)),
    next(pred: (f: any) => boolean, timeoutMs = 10_000): Promise<any> {
      const found = frames.find(pred);
      if (found) {
        frames.splice(frames.indexOf(found), 1);
        return Promise.resolve(found);
      }
      return new Promise((resolve, reject) => {
        const t = setTimeout(() => reject(new Error(`no matching frame in ${timeoutMs} ms; got ${JSON.stringify(frames.slice(-5))}`)), timeoutMs);
        waiters.push({ pred, resolve: (f) => (clearTimeout(t), resolve(f)) });
      });
    },
    /** PTY output of a session, decoded, until `pattern` shows up. */
    async ptyUntil(session: string, pattern: RegExp, timeoutMs = 10_000): Promise<string> {
      let text = "";
      const deadline = Date.now() + timeoutMs;
      while (!pattern.test(text)) {
        const f = await reader.next((x) => x.type === "pty.output" && x.session_id === session, Math.max(1, deadline - Date.now()));
        text += Buffer.from(f.data_base64, "base64").toString("utf8");
      }
      return text;
    },
  };
  return reader;
}
