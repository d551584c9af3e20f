// E2B processes of each machine: one agent stream socket per machine carries every command and PTY the SDK
// starts, so a command outlives the request that started it and can be re-attached by pid (envd's Connect).
// The processes themselves live in the guest agent, started `keep` (src/agent/kept.ts): they outlive the socket,
// which closes when the machine leaves `running` (a pause) or the server stops. The socket opened after a resume (or
// a restart) finds them again through the agent (kept.list) and re-attaches one on its first Connect, replaying the
// output it missed (from the offset this table last saw, kept across the pause) before the live output.

import { randomUUID } from "node:crypto";
import type { WebSocket } from "ws";
import type { MachineService } from "../../machines/service.ts";
import type { FileEventFrame, KeptInfo, ResyncRequiredFrame, StreamClientFrame, StreamServerFrame } from "../../agent/protocol.ts";
import { ConnectFailure } from "./connect.ts";
import type { ConnectCode } from "./connect.ts";

/** envd's ProcessEvent in proto3 JSON (bytes as base64). */
export type ProcessEvent =
  | { start: { pid: number } }
  | { data: { stdout: string } | { stderr: string } | { pty: string } }
  | { end: { exitCode: number; exited: boolean; status: string; error?: string } }
  | { keepalive: Record<string, never> };

export interface ProcessConfig {
  cmd: string;
  args: string[];
  envs: Record<string, string>;
  cwd?: string;
}

/** What a listener sees: the process's events, or `gone` when its machine stopped under it (no end will come). */
export type ProcessNotice = ProcessEvent | { gone: string };
type Listener = (event: ProcessNotice) => void;
/** Sees a watch's events; `end` when the watch ended without being asked (machine stopped, watcher failed). */
export type WatchListener = (frame: FileEventFrame | ResyncRequiredFrame | { type: "end"; error: string }) => void;

const START_TIMEOUT_MS = 30_000;

interface Proc {
  pid: number;
  config: ProcessConfig;
  tag?: string;
  /** Set for PTY processes: the agent's session id. */
  sessionId?: string;
  listeners: Set<Listener>;
  /** Offset of the next output byte (the agent numbers a kept process's output); a re-attach replays from here. */
  offset: number;
}

interface MachineTable {
  ws: WebSocket;
  ready: Promise<void>;
  procs: Map<number, Proc>;
  /** Starts awaiting the agent's answer; `started` registers the process synchronously, before the next frame. */
  pending: Map<string, { started: (pid: number, sessionId?: string) => void; reject: (err: Error) => void }>;
  /** File watches of this machine's socket (the agent's watches, src/agent/watch.ts), by watch id. */
  watches: Map<string, WatchListener>;
  watchPending: Map<string, { started: (watchId: string) => void; reject: (err: Error) => void }>;
  /** kept.list and re-attach requests awaiting the agent's answer, by request id. */
  asks: Map<string, { answered: (f: StreamServerFrame) => void; reject: (err: Error) => void }>;
  /** Re-attaches under way, by pid: a second Connect joins the first instead of replaying twice. */
  adopting: Map<number, Promise<Proc>>;
}

const AGENT_TO_CONNECT: Record<string, ConnectCode> = { invalid_request: "invalid_argument", not_found: "not_found", forbidden: "permission_denied", conflict: "failed_precondition", timeout: "deadline_exceeded" };

// Go's names for the signals a process usually dies of (os.ProcessState.String: "signal: killed").
const GO_SIGNAL_NAMES: Record<string, string> = {
  SIGKILL: "killed",
  SIGTERM: "terminated",
  SIGINT: "interrupt",
  SIGHUP: "hangup",
  SIGQUIT: "quit",
  SIGABRT: "aborted",
  SIGSEGV: "segmentation fault",
  SIGPIPE: "broken pipe",
  SIGBUS: "bus error",
  SIGFPE: "floating point exception",
  SIGILL: "illegal instruction",
  SIGUSR1: "user defined signal 1",
  SIGUSR2: "user defined signal 2",
};

/**
 * A process's end as envd reports it (Go's ProcessState): `exit status N`, or `signal: killed` with exit code -1;
 * `error` is cmd.Wait's error, the same words, set whenever the process did not exit 0 (the SDK's CommandExitError
 * message).
 */
export function endEvent(exitCode: number | null, signal: string | null): ProcessEvent {
  if (signal) {
    const status = `signal: ${GO_SIGNAL_NAMES[signal] ?? signal}`;
    return { end: { exitCode: -1, exited: false, status, error: status } };
  }
  const code = exitCode ?? -1;
  const status = `exit status ${code}`;
  return { end: { exitCode: code, exited: true, status, ...(code !== 0 ? { error: status } : {}) } };
}

export function createProcessRegistry(machines: MachineService) {
  const tables = new Map<string, MachineTable>();
  /**
   * Where each process's output stood when its machine's socket closed (a pause): the re-attach after the resume
   * replays from there. Held while the machine is hibernated; bounded by the agent's kept-process bound.
   */
  const seen = new Map<string, Map<number, number>>();

  machines.onStatus((id, status) => {
    if (status !== "running") drop(id, "the machine stopped running");
    if (status === "destroyed" || status === "failed") seen.delete(id);
  });

  function drop(machineId: string, why: string) {
    const t = tables.get(machineId);
    if (!t) return;
    tables.delete(machineId);
    // Merged: a process not re-attached since an earlier pause keeps the offset noted then.
    if (t.procs.size > 0) {
      const noted = seen.get(machineId) ?? new Map<number, number>();
      for (const p of t.procs.values()) noted.set(p.pid, p.offset);
      seen.set(machineId, noted);
    }
    for (const w of t.asks.values()) w.reject(new ConnectFailure("unavailable", why));
    t.asks.clear();
    t.adopting.clear();
    // No end event: the process did not end, its sandbox went away (envd's stream would break, and the SDK then
    // reports a timeout); the listeners end their streams with `unavailable`.
    for (const p of t.procs.values()) for (const l of p.listeners) l({ gone: why });
    t.procs.clear();
    for (const w of t.pending.values()) w.reject(new ConnectFailure("unavailable", why));
    t.pending.clear();
    for (const l of t.watches.values()) l({ type: "end", error: why });
    t.watches.clear();
    for (const w of t.watchPending.values()) w.reject(new ConnectFailure("unavailable", why));
    t.watchPending.clear();
    t.ws.close();
  }

  function emit(t: MachineTable, pid: number, event: ProcessNotice) {
    const p = t.procs.get(pid);
    if (p) for (const l of p.listeners) l(event);
  }

  /** Output of a kept process: delivered once (a re-attach's replay may overlap what was seen), its offset noted. */
  function output(t: MachineTable, pid: number, offset: number | undefined, dataBase64: string, event: ProcessNotice) {
    const p = t.procs.get(pid);
    if (!p) return;
    if (offset !== undefined) {
      const end = offset + Buffer.byteLength(dataBase64, "base64");
      if (end <= p.offset) return;
      p.offset = end;
    }
    for (const l of p.listeners) l(event);
  }

  function answer(t: MachineTable, requestId: string | undefined, f: StreamServerFrame) {
    const w = requestId ? t.asks.get(requestId) : undefined;
    if (!w) return;
    t.asks.delete(requestId!);
    w.answered(f);
  }

  function onFrame(machineId: string, t: MachineTable, f: StreamServerFrame) {
    switch (f.type) {
      case "exec.started":
      case "pty.started": {
        const w = f.request_id ? t.pending.get(f.request_id) : undefined;
        if (w) {
          t.pending.delete(f.request_id!);
          w.started(f.pid, f.type === "pty.started" ? f.session_id : undefined);
        }
        return;
      }
      case "exec.stdout":
        return output(t, f.pid, f.offset, f.data_base64, { data: { stdout: f.data_base64 } });
      case "exec.stderr":
        return output(t, f.pid, f.offset, f.data_base64, { data: { stderr: f.data_base64 } });
      case "pty.output":
        return output(t, f.pid, f.offset, f.data_base64, { data: { pty: f.data_base64 } });
      case "kept.listed":
      case "exec.attached":
      case "pty.reconnected":
        return answer(t, f.request_id, f);
      case "exec.exit":
      case "pty.exit": {
        emit(t, f.pid, endEvent(f.exit_code, f.signal));
        t.procs.delete(f.pid);
        return;
      }
      case "file_watch.started": {
        const w = f.request_id ? t.watchPending.get(f.request_id) : undefined;
        if (w) {
          t.watchPending.delete(f.request_id!);
          w.started(f.watch_id);
        }
        return;
      }
      case "file_event":
      case "resync_required":
        return t.watches.get(f.watch_id)?.(f);
      case "error": {
        if (f.watch_id) {
          t.watches.get(f.watch_id)?.({ type: "end", error: f.error });
          t.watches.delete(f.watch_id);
        }
        const w = f.request_id ? (t.pending.get(f.request_id) ?? t.watchPending.get(f.request_id) ?? t.asks.get(f.request_id)) : undefined;
        if (w) {
          t.pending.delete(f.request_id!);
          t.watchPending.delete(f.request_id!);
          t.asks.delete(f.request_id!);
          w.reject(new ConnectFailure(AGENT_TO_CONNECT[f.code] ?? "internal", f.error));
        }
        return;
      }
      default:
        void machineId;
    }
  }

  async function tableOf(machineId: string): Promise<MachineTable> {
    let t = tables.get(machineId);
    if (!t) {
      const { agent } = await machines.agentOf(machineId);
      t = tables.get(machineId);
      if (!t) {
        const ws = agent.openStream();
        const table: MachineTable = {
          ws,
          procs: new Map(),
          pending: new Map(),
          watches: new Map(),
          watchPending: new Map(),
          asks: new Map(),
          adopting: new Map(),
          ready: new Promise<void>((resolve, reject) => {
            ws.once("open", () => resolve());
            ws.once("error", (err) => reject(new ConnectFailure("unavailable", `the machine's agent is unreachable (${err.message})`)));
          }),
        };
        table.ready.catch(() => undefined);
        ws.on("message", (raw) => {
          try {
            onFrame(machineId, table, JSON.parse(raw.toString()) as StreamServerFrame);
          } catch {
            // a frame that is not JSON cannot be routed; the agent never sends one
          }
        });
        ws.on("error", () => undefined);
        ws.on("close", () => {
          if (tables.get(machineId) === table) drop(machineId, "the machine's agent closed the stream");
        });
        tables.set(machineId, table);
        t = table;
      }
    }
    await t.ready;
    return t;
  }

  function send(t: MachineTable, frame: StreamClientFrame) {
    if (t.ws.readyState !== t.ws.OPEN) throw new ConnectFailure("unavailable", "the machine's agent stream is closed");
    t.ws.send(JSON.stringify(frame));
  }

  /** Starts a command (or a PTY when `pty` is given); `listener` sees every event after start. */
  async function start(
    machineId: string,
    input: { config: ProcessConfig; user: string; tag?: string; stdin: boolean; pty?: { cols: number; rows: number } },
    listener: Listener,
  ): Promise<number> {
    const t = await tableOf(machineId);
    const requestId = randomUUID();
    const started = new Promise<number>((resolve, reject) => {
      // The agent answers a start at once (started or error); one that never comes is a stuck agent, not a wait.
      const timer = setTimeout(() => {
        t.pending.delete(requestId);
        reject(new ConnectFailure("deadline_exceeded", `the machine's agent did not start the process within ${START_TIMEOUT_MS / 1000} s`));
      }, START_TIMEOUT_MS);
      const started = (pid: number, sessionId?: string) => {
        clearTimeout(timer);
        // Registered while the started frame is handled: output frames of this pid read right after it find it.
        t.procs.set(pid, { pid, config: input.config, tag: input.tag, sessionId, listeners: new Set([listener]), offset: 0 });
        resolve(pid);
      };
      t.pending.set(requestId, {
        started,
        reject: (err) => {
          clearTimeout(timer);
          reject(err);
        },
      });
    });
    // Kept: envd's processes outlive every connection, and a pause (src/agent/kept.ts).
    const common = { request_id: requestId, cmd: input.config.cmd, args: input.config.args, cwd: input.config.cwd, envs: input.config.envs, user: input.user, keep: true, ...(input.tag !== undefined ? { label: input.tag } : {}) };
    try {
      if (input.pty) send(t, { type: "pty.start", ...common, cols: input.pty.cols, rows: input.pty.rows });
      else send(t, { type: "exec.start", ...common, stdin: input.stdin });
    } catch (err) {
      t.pending.get(requestId)?.reject(err as Error);
      t.pending.delete(requestId);
    }
    return started;
  }

  /**
   * Asks the agent something on the machine's socket and waits (bounded) for the frame answering it; `onAnswer` runs
   * synchronously as the answer is handled, before any frame behind it (a promise's reaction would come too late).
   */
  function ask<F extends StreamServerFrame>(t: MachineTable, frame: StreamClientFrame & { request_id: string }, onAnswer?: (f: F) => void): Promise<F> {
    return new Promise<F>((resolve, reject) => {
      const timer = setTimeout(() => {
        t.asks.delete(frame.request_id);
        reject(new ConnectFailure("deadline_exceeded", `the machine's agent did not answer ${frame.type} within ${START_TIMEOUT_MS / 1000} s`));
      }, START_TIMEOUT_MS);
      t.asks.set(frame.request_id, {
        answered: (f) => {
          clearTimeout(timer);
          onAnswer?.(f as F);
          resolve(f as F);
        },
        reject: (err) => {
          clearTimeout(timer);
          reject(err);
        },
      });
      try {
        send(t, frame);
      } catch (err) {
        t.asks.delete(frame.request_id);
        clearTimeout(timer);
        reject(err as Error);
      }
    });
  }

  /** What the agent keeps; offsets noted for processes it no longer has are dropped (bounds `seen`). */
  async function keptList(machineId: string, t: MachineTable): Promise<KeptInfo[]> {
    const f = await ask<Extract<StreamServerFrame, { type: "kept.listed" }>>(t, { type: "kept.list", request_id: randomUUID() });
    const noted = seen.get(machineId);
    if (noted) {
      const held = new Set(f.processes.map((k) => k.pid));
      for (const pid of noted.keys()) if (!held.has(pid)) noted.delete(pid);
      if (noted.size === 0) seen.delete(machineId);
    }
    return f.processes;
  }

  function configOf(k: KeptInfo): ProcessConfig {
    return { cmd: k.cmd ?? "", args: k.args ?? [], envs: k.envs ?? {}, ...(k.cwd !== undefined ? { cwd: k.cwd } : {}) };
  }

  /** A kept process this socket has not seen yet (started before a pause or a restart), looked up in the agent. */
  async function lookUp(machineId: string, t: MachineTable, selector: { pid?: number; tag?: string }): Promise<KeptInfo | undefined> {
    const all = await keptList(machineId, t);
    // An exited one (in the agent's grace) is still found by pid, so wait() after a resume gives its exit.
    if (selector.pid !== undefined) return all.find((k) => k.pid === selector.pid);
    return all.find((k) => k.running && k.label === selector.tag);
  }

  /**
   * Attaches this socket to a kept process: the agent replays its output from where this table last saw it (before
   * the pause; from the oldest byte it holds when unknown, after a restart), then goes on live. `listener` sees the
   * replay: it is registered as the agent's answer is handled, before the replayed frames.
   */
  function adopt(machineId: string, t: MachineTable, k: KeptInfo, listener: Listener): Promise<Proc> {
    const under = t.adopting.get(k.pid);
    if (under) return under.then((p) => (p.listeners.add(listener), p));
    const from = seen.get(machineId)?.get(k.pid);
    const requestId = randomUUID();
    const proc: Proc = { pid: k.pid, config: configOf(k), ...(k.label !== undefined ? { tag: k.label } : {}), ...(k.session_id ? { sessionId: k.session_id } : {}), listeners: new Set([listener]), offset: from ?? 0 };
    const promise = new Promise<Proc>((resolve, reject) => {
      // Registered synchronously with the answer, as a start is: the replay frames right behind it find the process.
      const registerOn = (f: StreamServerFrame) => {
        if (f.type === "exec.attached" || f.type === "pty.reconnected") proc.offset = Math.max(proc.offset, f.offset);
        t.procs.set(k.pid, proc);
        seen.get(machineId)?.delete(k.pid);
        return proc;
      };
      const frame = k.kind === "pty"
        ? ({ type: "pty.reconnect", request_id: requestId, session_id: k.session_id!, ...(from !== undefined ? { offset: from } : {}) } as const)
        : ({ type: "exec.attach", request_id: requestId, pid: k.pid, ...(from !== undefined ? { offset: from } : {}) } as const);
      ask(t, frame, registerOn).then(() => resolve(proc), reject);
    });
    t.adopting.set(k.pid, promise);
    const clear = () => {
      if (t.adopting.get(k.pid) === promise) t.adopting.delete(k.pid);
    };
    promise.then(clear, clear);
    return promise;
  }

  async function find(machineId: string, selector: { pid?: number; tag?: string }): Promise<{ t: MachineTable; p: Proc }> {
    const t = await tableOf(machineId);
    let p: Proc | undefined;
    if (selector.pid !== undefined) p = t.procs.get(selector.pid);
    else if (selector.tag !== undefined) p = [...t.procs.values()].find((x) => x.tag === selector.tag);
    if (!p) {
      // Not seen on this socket: one kept from before the pause is reached by pid (its session id for a PTY).
      const k = await lookUp(machineId, t, selector);
      if (k?.running) p = { pid: k.pid, config: configOf(k), ...(k.session_id ? { sessionId: k.session_id } : {}), listeners: new Set(), offset: 0 };
    }
    if (!p) throw new ConnectFailure("not_found", `process with ${selector.pid !== undefined ? `pid ${selector.pid}` : `tag ${selector.tag}`} not found`);
    return { t, p };
  }

  /** Opens a file watch in the machine (an absolute path); resolves with the function that ends it. */
  async function watch(machineId: string, path: string, recursive: boolean, listener: WatchListener): Promise<() => void> {
    const t = await tableOf(machineId);
    const requestId = randomUUID();
    const watchId = await new Promise<string>((resolve, reject) => {
      const timer = setTimeout(() => {
        t.watchPending.delete(requestId);
        reject(new ConnectFailure("deadline_exceeded", `the machine's agent did not start the watch within ${START_TIMEOUT_MS / 1000} s`));
      }, START_TIMEOUT_MS);
      t.watchPending.set(requestId, {
        started: (id) => {
          clearTimeout(timer);
          t.watches.set(id, listener);
          resolve(id);
        },
        reject: (err) => {
          clearTimeout(timer);
          reject(err);
        },
      });
      try {
        send(t, { type: "file_watch", request_id: requestId, path, recursive });
      } catch (err) {
        t.watchPending.delete(requestId);
        clearTimeout(timer);
        reject(err as Error);
      }
    });
    return () => {
      if (!t.watches.delete(watchId)) return;
      if (t.ws.readyState === t.ws.OPEN) t.ws.send(JSON.stringify({ type: "file_unwatch", watch_id: watchId }));
    };
  }

  return {
    start,
    watch,
    /** Adds a listener to a running process; returns its pid and the function that removes the listener. */
    async attach(machineId: string, selector: { pid?: number; tag?: string }, listener: Listener): Promise<{ pid: number; detach: () => void }> {
      const t = await tableOf(machineId);
      let p = selector.pid !== undefined ? t.procs.get(selector.pid) : [...t.procs.values()].find((x) => x.tag === selector.tag);
      if (p) p.listeners.add(listener);
      else {
        const k = await lookUp(machineId, t, selector);
        if (!k) throw new ConnectFailure("not_found", `process with ${selector.pid !== undefined ? `pid ${selector.pid}` : `tag ${selector.tag}`} not found`);
        p = await adopt(machineId, t, k, listener);
      }
      const proc = p;
      return { pid: proc.pid, detach: () => proc.listeners.delete(listener) };
    },
    detach(machineId: string, pid: number, listener: Listener) {
      tables.get(machineId)?.procs.get(pid)?.listeners.delete(listener);
    },
    /** The machine's running commands, as the agent keeps them (those started before a pause included). */
    async list(machineId: string) {
      const t = await tableOf(machineId);
      return (await keptList(machineId, t)).filter((k) => k.running).map((k) => ({ pid: k.pid, config: t.procs.get(k.pid)?.config ?? configOf(k), ...(k.label !== undefined ? { tag: k.label } : {}) }));
    },
    async input(machineId: string, selector: { pid?: number; tag?: string }, data: { stdin?: string; pty?: string }) {
      const { t, p } = await find(machineId, selector);
      if (data.pty !== undefined) {
        if (!p.sessionId) throw new ConnectFailure("invalid_argument", `process ${p.pid} has no PTY`);
        send(t, { type: "pty.input", session_id: p.sessionId, data_base64: data.pty });
      } else if (data.stdin !== undefined) {
        if (p.sessionId) send(t, { type: "pty.input", session_id: p.sessionId, data_base64: data.stdin });
        else send(t, { type: "exec.stdin", pid: p.pid, data_base64: data.stdin });
      }
    },
    async closeStdin(machineId: string, selector: { pid?: number; tag?: string }) {
      const { t, p } = await find(machineId, selector);
      if (p.sessionId) throw new ConnectFailure("invalid_argument", `process ${p.pid} is a PTY; send EOT (Ctrl-D) instead`);
      send(t, { type: "exec.stdin", pid: p.pid, eof: true });
    },
    async signal(machineId: string, selector: { pid?: number; tag?: string }, signal: "SIGKILL" | "SIGTERM") {
      const { t, p } = await find(machineId, selector);
      if (p.sessionId) send(t, { type: "pty.kill", session_id: p.sessionId, signal });
      else send(t, { type: "exec.signal", pid: p.pid, signal });
    },
    async resize(machineId: string, selector: { pid?: number; tag?: string }, size: { cols: number; rows: number }) {
      const { t, p } = await find(machineId, selector);
      if (!p.sessionId) throw new ConnectFailure("invalid_argument", `process ${p.pid} has no PTY`);
      send(t, { type: "pty.resize", session_id: p.sessionId, cols: size.cols, rows: size.rows });
    },
    close() {
      for (const id of [...tables.keys()]) drop(id, "the server is shutting down");
    },
  };
}

export type ProcessRegistry = ReturnType<typeof createProcessRegistry>;
