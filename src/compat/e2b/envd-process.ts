// envd's process.Process over Connect: start and connect (server streams of process events), list, input, stdin
// close, signals and PTY resize, each a translation onto the machine's processes (processes.ts).

import type { FastifyRequest } from "fastify";
import { ConnectFailure } from "./connect.ts";
import type { ServerStream } from "./connect.ts";
import type { ProcessConfig, ProcessNotice, ProcessRegistry } from "./processes.ts";
import { base64Of, isObj, keepaliveEveryS, str, uint } from "./envd-wire.ts";
import type { EnvdKit } from "./envd-wire.ts";

function selectorOf(msg: Record<string, unknown>): { pid?: number; tag?: string } {
  const p = msg.process;
  if (!isObj(p)) throw new ConnectFailure("invalid_argument", "process selector is required");
  if (p.pid !== undefined) return { pid: uint(p.pid, "process.pid") };
  if (p.tag !== undefined) return { tag: str(p.tag, "process.tag") };
  throw new ConnectFailure("invalid_argument", "process selector needs pid or tag");
}

/** Streams process events to the client: start first, then everything the process does, keepalives between. */
function pipeProcess(processes: ProcessRegistry, req: FastifyRequest, stream: ServerStream, machineId: string, attach: (listener: (e: ProcessNotice) => void) => Promise<number>) {
  return new Promise<void>((resolve, reject) => {
    const queued: ProcessNotice[] = [];
    let pid: number | undefined;
    const listener = (e: ProcessNotice) => {
      if (pid === undefined) return void queued.push(e);
      // The sandbox stopped under the process: `unavailable`, which the SDK reports as its timeout error.
      if ("gone" in e) return stream.end(new ConnectFailure("unavailable", `the sandbox is not running anymore (${e.gone})`));
      stream.send({ event: e });
      if ("end" in e) stream.end();
    };
    attach(listener).then((p) => {
      pid = p;
      stream.send({ event: { start: { pid: p } } });
      for (const e of queued.splice(0)) listener(e);
      const everyS = keepaliveEveryS(req);
      const timer = setInterval(() => stream.send({ event: { keepalive: {} } }), everyS * 1000);
      stream.onClose(() => {
        clearInterval(timer);
        // The client went away (or the process ended): the process goes on, only this listener stops.
        processes.detach(machineId, p, listener);
      });
      resolve();
    }, reject);
  });
}


export function processRpcs(kit: EnvdKit): void {
  const { processes, context, resolvePath, unary, serverStream } = kit;

  serverStream("process.Process/Start", async (msg, req, stream) => {
    const { id, user, home } = await context(req);
    const p = msg.process;
    if (!isObj(p)) throw new ConnectFailure("invalid_argument", "process is required");
    const args = p.args ?? [];
    if (!Array.isArray(args) || !args.every((a) => typeof a === "string")) throw new ConnectFailure("invalid_argument", "process.args must be strings");
    const envs = p.envs ?? {};
    if (!isObj(envs) || !Object.values(envs).every((v) => typeof v === "string")) throw new ConnectFailure("invalid_argument", "process.envs must map names to strings");
    const cwd = str(p.cwd, "process.cwd", { optional: true });
    const config: ProcessConfig = { cmd: str(p.cmd, "process.cmd")!, args: args as string[], envs: envs as Record<string, string>, cwd: cwd ? resolvePath(cwd, home) : home };
    let pty: { cols: number; rows: number } | undefined;
    if (msg.pty !== undefined && msg.pty !== null) {
      const size = isObj(msg.pty) && isObj(msg.pty.size) ? msg.pty.size : {};
      pty = { cols: uint(size.cols, "pty.size.cols") || 80, rows: uint(size.rows, "pty.size.rows") || 24 };
    }
    const tag = str(msg.tag, "tag", { optional: true });
    const s = stream();
    await pipeProcess(processes, req, s, id, (listener) => processes.start(id, { config, user, tag, stdin: msg.stdin === true, pty }, listener));
  });

  serverStream("process.Process/Connect", async (msg, req, stream) => {
    const { id } = await context(req);
    const selector = selectorOf(msg);
    const s = stream();
    await pipeProcess(processes, req, s, id, async (listener) => (await processes.attach(id, selector, listener)).pid);
  });

  unary("process.Process/List", async (_msg, req) => {
    const { id } = await context(req);
    return { processes: await processes.list(id) };
  });

  unary("process.Process/SendInput", async (msg, req) => {
    const { id } = await context(req);
    const input = isObj(msg.input) ? msg.input : {};
    if (input.stdin !== undefined) await processes.input(id, selectorOf(msg), { stdin: base64Of(input.stdin, "input.stdin") });
    else if (input.pty !== undefined) await processes.input(id, selectorOf(msg), { pty: base64Of(input.pty, "input.pty") });
    else throw new ConnectFailure("invalid_argument", "input needs stdin or pty");
    return {};
  });

  unary("process.Process/CloseStdin", async (msg, req) => {
    const { id } = await context(req);
    await processes.closeStdin(id, selectorOf(msg));
    return {};
  });

  unary("process.Process/SendSignal", async (msg, req) => {
    const { id } = await context(req);
    const signal = msg.signal === "SIGNAL_SIGKILL" || msg.signal === 9 ? "SIGKILL" : msg.signal === "SIGNAL_SIGTERM" || msg.signal === 15 ? "SIGTERM" : undefined;
    if (!signal) throw new ConnectFailure("invalid_argument", "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM");
    await processes.signal(id, selectorOf(msg), signal);
    return {};
  });

  unary("process.Process/Update", async (msg, req) => {
    const { id } = await context(req);
    const size = isObj(msg.pty) && isObj(msg.pty.size) ? msg.pty.size : undefined;
    if (!size) return {};
    const cols = uint(size.cols, "pty.size.cols");
    const rows = uint(size.rows, "pty.size.rows");
    if (!cols || !rows || cols > 1000 || rows > 1000) throw new ConnectFailure("invalid_argument", "pty.size needs cols and rows from 1 to 1000");
    await processes.resize(id, selectorOf(msg), { cols, rows });
    return {};
  });

  serverStream("process.Process/StreamInput", async () => {
    throw new ConnectFailure("unimplemented", "StreamInput is a client stream, which the Connect JSON protocol over HTTP/1.1 cannot carry; use SendInput");
  });
}
