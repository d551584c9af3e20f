// `kiln machines shell <id>`: an interactive terminal in a machine over the machine WebSocket. Raw mode, resize
// on SIGWINCH, and after a dropped connection it reconnects to the same PTY session and replays what it missed.
// Without a terminal on stdin (a pipe, a file, a script) the shell runs without a PTY instead, reading its commands
// from stdin until it ends, as `docker exec -i` does.

import { WebSocket } from "ws";
import type { ApiClient } from "./client.ts";
import { streamExec } from "./exec-stream.ts";

/** A login shell where the machine has bash, else sh: what a person gets at a terminal. */
const LOGIN_SHELL = "if command -v bash >/dev/null 2>&1; then exec bash -l; else exec sh -l; fi";

export async function openShell(client: ApiClient, id: string, opts: { cmd?: string; user?: string }): Promise<number> {
  if (!process.stdin.isTTY) return streamExec(client, id, { cmd: opts.cmd ?? LOGIN_SHELL, user: opts.user }, { stdin: true });
  const url = `${client.baseUrl.replace(/^http/, "ws")}/v1/machines/${id}/ws`;
  const stdin = process.stdin;
  const stdout = process.stdout;
  let session: { id: string; pid: number } | undefined;
  let offset = 0;
  let exitCode: number | undefined;

  const size = () => ({ cols: stdout.columns || 80, rows: stdout.rows || 24 });
  if (stdin.isTTY) stdin.setRawMode(true);
  stdin.resume();

  return new Promise<number>((resolve) => {
    let ws: WebSocket;
    let attempts = 0;

    const finish = (code: number) => {
      if (stdin.isTTY) stdin.setRawMode(false);
      stdin.pause();
      process.off("SIGWINCH", onResize);
      resolve(code);
    };
    const send = (frame: unknown) => {
      if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(frame));
    };
    const onResize = () => session && send({ type: "pty.resize", session_id: session.id, ...size() });
    process.on("SIGWINCH", onResize);
    // Keys typed (or pasted) before the session exists are held, not dropped, and sent once it starts.
    const early: Buffer[] = [];
    const input = (data: Buffer) => send({ type: "pty.input", session_id: session!.id, data_base64: data.toString("base64") });
    stdin.on("data", (data: Buffer) => (session ? input(data) : early.push(data)));

    const connect = () => {
      ws = new WebSocket(url, { headers: { authorization: `Bearer ${client.key}` } });
      ws.on("open", () => {
        attempts = 0;
        if (session) send({ type: "pty.reconnect", session_id: session.id, offset });
        else send({ type: "pty.start", request_id: "shell", ...(opts.cmd ? { cmd: opts.cmd } : {}), ...(opts.user ? { user: opts.user } : {}), ...size() });
      });
      ws.on("message", (raw) => {
        const f = JSON.parse(raw.toString());
        if (f.type === "pty.started") {
          session = { id: f.session_id, pid: f.pid };
          for (const data of early.splice(0)) input(data);
        }
        else if (f.type === "pty.output") {
          const bytes = Buffer.from(f.data_base64, "base64");
          // Replays may overlap what we already printed: skip bytes before our offset.
          const skip = Math.max(0, offset - f.offset);
          if (skip < bytes.length) stdout.write(bytes.subarray(skip));
          offset = Math.max(offset, f.offset + bytes.length);
        } else if (f.type === "pty.exit") {
          exitCode = f.exit_code ?? 1;
          ws.close();
        } else if (f.type === "error") {
          process.stderr.write(`\r\nkiln: ${f.code}: ${f.error}\r\n`);
          if (f.code === "not_found" || !session) {
            exitCode = 1;
            ws.close();
          }
        }
      });
      ws.on("unexpected-response", (_req, res) => {
        let body = "";
        res.on("data", (d) => (body += d));
        res.on("end", () => {
          process.stderr.write(`kiln: ${res.statusCode}: ${body}\n`);
          exitCode = 1;
          finish(1);
        });
      });
      ws.on("error", () => undefined);
      ws.on("close", () => {
        if (exitCode !== undefined) return finish(exitCode);
        if (++attempts > 20) return finish(1);
        // The connection dropped with the session still alive: reconnect and replay from our offset.
        setTimeout(connect, Math.min(2000, 100 * attempts));
      });
    };
    connect();
  });
}
