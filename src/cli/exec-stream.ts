// `kiln machines exec` over the machine WebSocket: output is written as it arrives (exact bytes, stdout and stderr
// apart), `-i` streams our stdin to the command, and a timeout or Ctrl-C keeps everything already printed.

import { constants } from "node:os";
import { WebSocket } from "ws";
import type { ApiClient } from "./client.ts";

export interface StreamExecRequest {
  cmd: string;
  args?: string[];
  user?: string;
  cwd?: string;
  envs?: Record<string, string>;
}

/** Exit status of `kiln machines exec` when the command outlives `--timeout` (as timeout(1) answers). */
export const EXEC_TIMEOUT_EXIT = 124;

/** Runs one command and resolves with the exit status to leave with (the command's, 128+signal, 124 on timeout). */
export function streamExec(client: ApiClient, id: string, req: StreamExecRequest, opts: { timeoutS?: number; stdin?: boolean } = {}): Promise<number> {
  const url = `${client.baseUrl.replace(/^http/, "ws")}/v1/machines/${encodeURIComponent(id)}/ws`;
  const ws = new WebSocket(url, { headers: { authorization: `Bearer ${client.key}` }, maxPayload: 64 * 1024 * 1024 });
  let pid: number | undefined;
  let timer: NodeJS.Timeout | undefined;
  let settled = false;

  return new Promise<number>((resolve) => {
    const finish = (code: number, message?: string) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      process.off("SIGINT", onInterrupt);
      if (opts.stdin) process.stdin.pause();
      if (message) process.stderr.write(`kiln: ${message}\n`);
      // Closing the socket ends whatever the command left running (the agent kills a closed socket's processes).
      if (ws.readyState === WebSocket.OPEN || ws.readyState === WebSocket.CONNECTING) ws.close();
      resolve(code);
    };
    const send = (frame: Record<string, unknown>, cb?: () => void) => {
      if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(frame), cb);
    };
    const onInterrupt = () => {
      if (pid !== undefined) send({ type: "exec.signal", pid, signal: "SIGKILL" });
      finish(130, "interrupted: the command was killed");
    };
    process.on("SIGINT", onInterrupt);

    // Our output backs up into the socket (and from there into the command's pipes) when stdout is slow.
    const write = (stream: NodeJS.WriteStream, bytes: Buffer) => {
      if (!stream.write(bytes)) {
        ws.pause();
        stream.once("drain", () => ws.resume());
      }
    };

    const pipeStdin = () => {
      const stdin = process.stdin;
      stdin.on("data", (chunk: Buffer) => {
        stdin.pause();
        send({ type: "exec.stdin", pid, data_base64: chunk.toString("base64") }, () => stdin.resume());
      });
      stdin.on("end", () => send({ type: "exec.stdin", pid, data_base64: "", eof: true }));
      stdin.resume();
    };

    ws.on("open", () => {
      send({ type: "exec.start", request_id: "exec", ...req, ...(opts.stdin ? { stdin: true } : {}) });
      if (opts.timeoutS) {
        timer = setTimeout(() => {
          if (pid !== undefined) send({ type: "exec.signal", pid, signal: "SIGKILL" });
          finish(EXEC_TIMEOUT_EXIT, `timeout: the command did not finish within ${opts.timeoutS} s and was killed (its output so far is above)`);
        }, opts.timeoutS * 1000);
      }
    });
    ws.on("message", (raw) => {
      const f = JSON.parse(raw.toString()) as Record<string, unknown>;
      switch (f.type) {
        case "exec.started":
          if (f.request_id !== "exec") return;
          pid = f.pid as number;
          if (opts.stdin) pipeStdin();
          return;
        case "exec.stdout":
        case "exec.stderr":
          if (f.pid === pid) write(f.type === "exec.stdout" ? process.stdout : process.stderr, Buffer.from(f.data_base64 as string, "base64"));
          return;
        case "exec.exit": {
          if (f.pid !== pid) return;
          const signal = f.signal as string | null;
          const signum = signal ? (constants.signals as Record<string, number>)[signal] : undefined;
          return finish(typeof f.exit_code === "number" ? f.exit_code : signum ? 128 + signum : 1, f.oom_killed ? "the command was killed by the OOM killer" : undefined);
        }
        case "error":
          return finish(1, `${f.code}: ${f.error}`);
      }
    });
    ws.on("unexpected-response", (_req, res) => {
      let body = "";
      res.on("data", (d: Buffer) => (body += d));
      res.on("end", () => {
        let parsed: { code?: string; error?: string; request_id?: string } = {};
        try {
          parsed = JSON.parse(body);
        } catch {
          // not an envelope: print the status alone
        }
        finish(1, `${parsed.code ?? res.statusCode}: ${parsed.error ?? body} (request ${parsed.request_id ?? "?"})`);
      });
    });
    ws.on("error", (err) => finish(1, `cannot reach ${client.baseUrl}: ${err.message} (is \`kiln serve\` running?)`));
    ws.on("close", (code, reason) => finish(1, `the connection to the machine closed before the command ended (${code}${reason.length ? ` ${reason}` : ""})`));
  });
}
