// The agent's stream socket (/ws): one JSON frame router per connection for exec streams and PTY sessions.
// Exec processes belong to the socket that started them, unless started with `keep` (kept.ts); PTY sessions live in
// the agent and outlive sockets.
// New stream features (file watches, kernels, port connects) add frame types here.

import type { WebSocket } from "ws";
import type { ChildProcess } from "node:child_process";
import { PtySession } from "./pty.ts";
import type { PtySink } from "./pty.ts";
import { spawnAs, isSignal } from "./process.ts";
import { signalTree } from "./process-tree.ts";
import { exitOf, oomKills } from "./oom.ts";
import { AgentFailure } from "./errors.ts";
import { createWatches } from "./watch.ts";
import { KEPT_LABEL_MAX, endAllKept, findKept, keptProcesses, makeRoom, startKept } from "./kept.ts";
import type { KeptProcess } from "./kept.ts";
import type { AgentErrorCode, StreamServerFrame } from "./protocol.ts";

const HIGH_WATER = 1024 * 1024;
const LOW_WATER = 256 * 1024;
/** Input (exec stdin, PTY input) the agent holds for one process before it stops reading the socket. */
const INPUT_HIGH_WATER = 1024 * 1024;
/** While reading is paused, a ping this often notices a control plane that went away (the write fails). */
const PAUSED_PROBE_MS = 1000;

/** Every live PTY session of this boot, by session id. */
const sessions = new Map<string, PtySession>();

function findSession(f: { session_id?: unknown; pid?: unknown }): PtySession | undefined {
  if (typeof f.session_id === "string") return sessions.get(f.session_id);
  if (typeof f.pid === "number") for (const s of sessions.values()) if (s.pid === f.pid) return s;
  return undefined;
}

/**
 * Ends every PTY session: a resumed machine starts a new execution (SPEC: sessions do not survive resume). Sessions
 * started with `keep` (the E2B layer, whose PTYs outlive a pause) are left, unless `all` (the agent is stopping,
 * and then kept exec processes end too).
 */
export function resetSessions(all = false): number {
  let n = 0;
  for (const s of [...sessions.values()]) {
    if (s.kept && !all) continue;
    s.end();
    n++;
  }
  if (all) n += endAllKept();
  return n;
}

function keptSessions(): number {
  let n = 0;
  for (const s of sessions.values()) if (s.kept) n++;
  return n;
}

function exactlyOne(f: Record<string, unknown>, a: string, b: string): boolean {
  return (f[a] !== undefined) !== (f[b] !== undefined);
}

function bytesOf(f: Record<string, unknown>): Buffer {
  if (typeof f.data_base64 === "string") return Buffer.from(f.data_base64, "base64");
  if (typeof f.data === "string") return Buffer.from(f.data, "utf8");
  return Buffer.alloc(0);
}

function requestIdOf(f: Record<string, unknown>): { request_id?: string } {
  return typeof f.request_id === "string" ? { request_id: f.request_id } : {};
}

/** Shapes of the fields exec.start and pty.start share; a wrong type answers invalid_request, not a crash. */
function checkSpawnFields(f: Record<string, unknown>) {
  const bad = (what: string) => {
    throw new AgentFailure("invalid_request", `${f.type} ${what}`);
  };
  if (f.args !== undefined && !(Array.isArray(f.args) && f.args.every((a) => typeof a === "string"))) bad("args must be an array of strings");
  if (f.cwd !== undefined && typeof f.cwd !== "string") bad("cwd must be a string");
  if (f.user !== undefined && typeof f.user !== "string") bad("user must be a string");
  if (f.envs !== undefined && (typeof f.envs !== "object" || f.envs === null || Object.values(f.envs).some((v) => typeof v !== "string"))) bad("envs must map names to strings");
  if (f.keep !== undefined && typeof f.keep !== "boolean") bad("keep must be a boolean");
  if (f.label !== undefined && !(typeof f.label === "string" && f.label.length <= KEPT_LABEL_MAX && f.keep === true)) bad(`label must be a string of at most ${KEPT_LABEL_MAX} characters, with keep: true`);
}

export function handleStream(ws: WebSocket) {
  const procs = new Map<number, ChildProcess>();
  const attached = new Set<PtySession>();
  /** Kept processes this socket is attached to (started here or re-attached by exec.attach). */
  const keptAttached = new Set<KeptProcess>();
  const pausedPipes = new Set<NodeJS.ReadableStream>();

  const send = (frame: StreamServerFrame) => {
    if (ws.readyState === ws.OPEN) ws.send(JSON.stringify(frame), relieve);
  };
  const sink: PtySink = { send, backlog: () => ws.bufferedAmount };
  const watches = createWatches(sink);

  // When the socket has flushed enough, let paused producers go again.
  function relieve() {
    if (ws.bufferedAmount > LOW_WATER) return;
    for (const p of pausedPipes) p.resume();
    pausedPipes.clear();
    for (const s of attached) s.applyBackpressure(HIGH_WATER, LOW_WATER);
    for (const p of keptAttached) p.applyBackpressure();
  }

  // Client → process backpressure: while any process has more than INPUT_HIGH_WATER of input queued, the
  // socket is not read, so the control plane's link backs up and it stops reading its client in turn.
  let held = 0;
  let probe: NodeJS.Timeout | undefined;
  function holdInputUntil(whenDrained: (release: () => void) => void) {
    if (held++ === 0) {
      ws.pause();
      probe = setInterval(() => {
        if (ws.readyState === ws.OPEN) ws.ping();
      }, PAUSED_PROBE_MS);
    }
    let released = false;
    const release = () => {
      if (released) return;
      released = true;
      if (--held === 0) {
        clearInterval(probe);
        ws.resume();
      }
    };
    whenDrained(release);
  }
  /** Releases once a child's stdin has drained, closed or failed, whichever comes first. */
  const stdinDrained = (stdin: NodeJS.WritableStream) => (release: () => void) => {
    const done = () => {
      stdin.off("drain", done).off("close", done).off("error", done);
      release();
    };
    stdin.on("drain", done).on("close", done).on("error", done);
  };

  const fail = (code: AgentErrorCode, error: string, requestId?: unknown) => send({ type: "error", code, error, ...(typeof requestId === "string" ? { request_id: requestId } : {}) });

  function pipeOut(child: ChildProcess, stream: NodeJS.ReadableStream, type: "exec.stdout" | "exec.stderr") {
    stream.on("data", (b: Buffer) => {
      send({ type, pid: child.pid!, data_base64: b.toString("base64") });
      if (ws.bufferedAmount > HIGH_WATER) {
        stream.pause();
        pausedPipes.add(stream);
      }
    });
  }

  /** A kept process: it outlives this socket (only detached when the socket goes), output ringed for re-attach. */
  function execStartKept(f: Record<string, unknown>) {
    let started = false;
    const config = { cmd: f.cmd as string, args: f.args as string[] | undefined, cwd: f.cwd as string | undefined, envs: f.envs as Record<string, string> | undefined, user: f.user as string | undefined, label: f.label as string | undefined };
    const child = startKept(config, { stdin: f.stdin === true, othersKept: keptSessions() }, (p) => {
      started = true;
      p.attach(sink);
      keptAttached.add(p);
      send({ type: "exec.started", ...requestIdOf(f), pid: p.pid });
    });
    child.on("error", (err: NodeJS.ErrnoException) => {
      if (!started) fail(err.code === "ENOENT" ? "invalid_request" : "internal", `Cannot start ${JSON.stringify(f.cmd)}: ${err.code ?? err.message}`, f.request_id);
    });
  }

  function execStart(f: Record<string, unknown>) {
    if (f.keep === true) return execStartKept(f);
    const child = spawnAs(
      { cmd: f.cmd as string, args: f.args as string[] | undefined, cwd: f.cwd as string | undefined, envs: f.envs as Record<string, string> | undefined, user: f.user as string | undefined },
      { stdin: f.stdin === true },
    );
    let started = false;
    const oomBefore = oomKills();
    child.on("spawn", () => {
      started = true;
      procs.set(child.pid!, child);
      send({ type: "exec.started", ...requestIdOf(f), pid: child.pid! });
    });
    child.on("error", (err: NodeJS.ErrnoException) => {
      if (!started) fail(err.code === "ENOENT" ? "invalid_request" : "internal", `Cannot start ${JSON.stringify(f.cmd)}: ${err.code ?? err.message}`, f.request_id);
    });
    child.stdin?.on("error", () => undefined);
    pipeOut(child, child.stdout!, "exec.stdout");
    pipeOut(child, child.stderr!, "exec.stderr");
    child.on("close", (code, signal) => {
      if (!started) return;
      procs.delete(child.pid!);
      send({ type: "exec.exit", pid: child.pid!, ...exitOf(code, signal, f.args === undefined, oomBefore) });
    });
  }

  function handle(f: Record<string, unknown>) {
    switch (f.type) {
      case "exec.start":
        if (typeof f.cmd !== "string" || !f.cmd) return fail("invalid_request", "exec.start needs cmd", f.request_id);
        checkSpawnFields(f);
        return execStart(f);
      case "exec.stdin": {
        const child = procs.get(f.pid as number);
        const keptProc = child ? undefined : findKept(f.pid);
        if (!child && !keptProc) return fail("not_found", `No process ${f.pid} on this socket`, f.request_id);
        if (!(child ? child.stdin : keptProc!.hasStdin)) return fail("invalid_request", `Process ${f.pid} was started without stdin (send stdin: true)`, f.request_id);
        const stdin = child ? child.stdin! : keptProc!.stdin;
        if (!stdin) return fail("not_found", `Process ${f.pid} has exited`, f.request_id);
        const data = bytesOf(f);
        if (data.length && (stdin as NodeJS.WritableStream & { writable: boolean }).writable) {
          stdin.write(data);
          if ((stdin as NodeJS.WritableStream & { writableLength: number }).writableLength > INPUT_HIGH_WATER) holdInputUntil(stdinDrained(stdin));
        }
        if (f.eof) stdin.end();
        return;
      }
      case "exec.signal": {
        const child = procs.get(f.pid as number);
        const keptProc = child ? undefined : findKept(f.pid);
        if (!child && !keptProc) return fail("not_found", `No process ${f.pid} on this socket`, f.request_id);
        const sig = String(f.signal);
        if (!isSignal(sig)) return fail("invalid_request", `Unknown signal ${sig}`, f.request_id);
        const name = (sig.startsWith("SIG") ? sig : `SIG${sig}`) as NodeJS.Signals;
        if (keptProc?.exit) return fail("not_found", `Process ${f.pid} has exited`, f.request_id);
        return child ? signalTree(child, name) : keptProc!.signal(name);
      }
      case "exec.attach": {
        const keptProc = findKept(f.pid);
        if (!keptProc) return fail("not_found", `No kept process ${f.pid} in this machine`, f.request_id);
        if (f.offset !== undefined && !(Number.isInteger(f.offset) && (f.offset as number) >= 0)) return fail("invalid_request", "exec.attach offset must be a non-negative integer", f.request_id);
        keptProc.attach(sink);
        keptAttached.add(keptProc);
        return keptProc.replay(sink, typeof f.offset === "number" ? f.offset : undefined, f.request_id as string | undefined);
      }
      case "kept.list": {
        const processes = [
          ...keptProcesses().map((p) => ({ kind: "exec" as const, pid: p.pid, ...p.config, running: !p.exit })),
          ...[...sessions.values()].filter((s) => s.kept).map((s) => ({ kind: "pty" as const, pid: s.pid, session_id: s.id, ...s.config, running: !s.exit })),
        ];
        return send({ type: "kept.listed", ...requestIdOf(f), processes });
      }
      case "pty.start": {
        if (f.cmd !== undefined && (typeof f.cmd !== "string" || !f.cmd)) return fail("invalid_request", "pty.start cmd must be a non-empty string", f.request_id);
        checkSpawnFields(f);
        for (const k of ["cols", "rows"]) {
          if (f[k] !== undefined && !(Number.isInteger(f[k]) && (f[k] as number) > 0 && (f[k] as number) <= 1000)) return fail("invalid_request", `pty.start ${k} must be an integer from 1 to 1000`, f.request_id);
        }
        if (f.keep === true) makeRoom(keptSessions());
        const session = new PtySession(
          {
            cmd: f.cmd as string | undefined,
            args: f.args as string[] | undefined,
            cwd: f.cwd as string | undefined,
            envs: f.envs as Record<string, string> | undefined,
            user: f.user as string | undefined,
            cols: Number(f.cols) || 80,
            rows: Number(f.rows) || 24,
            keep: f.keep === true,
            label: f.label as string | undefined,
          },
          () => {
            sessions.delete(session.id);
            attached.delete(session);
          },
        );
        sessions.set(session.id, session);
        session.attach(sink);
        attached.add(session);
        return send({ type: "pty.started", ...requestIdOf(f), session_id: session.id, pid: session.pid });
      }
      case "pty.input":
      case "pty.resize":
      case "pty.kill":
      case "pty.reconnect": {
        if (!exactlyOne(f, "session_id", "pid")) return fail("invalid_request", `${f.type} takes exactly one of session_id or pid`, f.request_id);
        if (f.type === "pty.input" && !exactlyOne(f, "data_base64", "data")) return fail("invalid_request", "pty.input takes exactly one of data_base64 or data", f.request_id);
        const session = findSession(f);
        if (!session) return fail("not_found", `No PTY session ${f.session_id ?? `with pid ${f.pid}`} in this machine's current execution`, f.request_id);
        if (f.type === "pty.input") {
          session.input(bytesOf(f));
          if (session.inputBacklog() > INPUT_HIGH_WATER) holdInputUntil((release) => session.onInputDrained(release));
          return;
        }
        if (f.type === "pty.resize") {
          if (![f.cols, f.rows].every((n) => Number.isInteger(n) && (n as number) > 0 && (n as number) <= 1000)) return fail("invalid_request", "pty.resize needs integer cols and rows from 1 to 1000", f.request_id);
          return session.resize(f.cols as number, f.rows as number);
        }
        if (f.type === "pty.kill") {
          const sig = typeof f.signal === "string" ? f.signal : "SIGHUP";
          if (!isSignal(sig)) return fail("invalid_request", `Unknown signal ${sig}`, f.request_id);
          return session.kill(sig.startsWith("SIG") ? sig : `SIG${sig}`);
        }
        if (f.offset !== undefined && !(Number.isInteger(f.offset) && (f.offset as number) >= 0)) return fail("invalid_request", "pty.reconnect offset must be a non-negative integer", f.request_id);
        session.attach(sink);
        attached.add(session);
        return session.replay(sink, typeof f.offset === "number" ? f.offset : undefined, f.request_id as string | undefined);
      }
      case "file_watch":
        return watches.start(f);
      case "file_unwatch":
        return watches.stop(f);
      default:
        return fail("invalid_request", `Unknown frame type ${JSON.stringify(f.type)}`, f.request_id);
    }
  }

  ws.on("message", (raw) => {
    let f: Record<string, unknown>;
    try {
      f = JSON.parse(raw.toString());
      if (typeof f !== "object" || f === null) throw new Error();
    } catch {
      return fail("invalid_request", "A frame must be a JSON object");
    }
    try {
      handle(f);
    } catch (err) {
      if (err instanceof AgentFailure) fail(err.code, err.message, f.request_id);
      else fail("internal", (err as Error).message, f.request_id);
    }
  });

  ws.on("error", () => undefined); // a broken link ends in "close" below
  ws.on("close", () => {
    clearInterval(probe);
    watches.closeAll();
    // Processes belong to the socket: when it goes, so does everything they started (setsid children included).
    for (const child of procs.values()) signalTree(child);
    procs.clear();
    for (const s of attached) s.detach(sink);
    attached.clear();
    // Kept processes live on for the next socket (exec.attach).
    for (const p of keptAttached) p.detach(sink);
    keptAttached.clear();
  });
}
