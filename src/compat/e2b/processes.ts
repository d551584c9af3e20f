// E2B processes of each machine: one agent stream socket per machine carries every command and PTY the SDK
// starts, so a command outlives the request that started it and can be re-attached by pid (envd's Connect).
// The processes themselves live in the guest agent; this table only routes their frames to whoever listens.
// A machine's socket closes when the machine leaves `running` (its exec processes end with it, as in the agent).

import { randomUUID } from "node:crypto";
import type { WebSocket } from "ws";
import type { MachineService } from "../../machines/service.ts";
import type { FileEventFrame, ResyncRequiredFrame, StreamClientFrame, StreamServerFrame } from "../../agent/protocol.ts";
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

  machines.onStatus((id, status) => {
    if (status !== "running") drop(id, "the machine stopped running");
  });

  function drop(machineId: string, why: string) {
    const t = tables.get(machineId);
    if (!t) return;
    tables.delete(machineId);
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
        return emit(t, f.pid, { data: { stdout: f.data_base64 } });
      case "exec.stderr":
        return emit(t, f.pid, { data: { stderr: f.data_base64 } });
      case "pty.output":
        return emit(t, f.pid, { data: { pty: f.data_base64 } });
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
        const w = f.request_id ? (t.pending.get(f.request_id) ?? t.watchPending.get(f.request_id)) : undefined;
        if (w) {
          t.pending.delete(f.request_id!);
          t.watchPending.delete(f.request_id!);
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
        t.procs.set(pid, { pid, config: input.config, tag: input.tag, sessionId, listeners: new Set([listener]) });
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
    const common = { request_id: requestId, cmd: input.config.cmd, args: input.config.args, cwd: input.config.cwd, envs: input.config.envs, user: input.user };
    try {
      if (input.pty) send(t, { type: "pty.start", ...common, cols: input.pty.cols, rows: input.pty.rows });
      else send(t, { type: "exec.start", ...common, stdin: input.stdin });
    } catch (err) {
      t.pending.get(requestId)?.reject(err as Error);
      t.pending.delete(requestId);
    }
    return started;
  }

  async function find(machineId: string, selector: { pid?: number; tag?: string }): Promise<{ t: MachineTable; p: Proc }> {
    const t = await tableOf(machineId);
    let p: Proc | undefined;
    if (selector.pid !== undefined) p = t.procs.get(selector.pid);
    else if (selector.tag !== undefined) p = [...t.procs.values()].find((x) => x.tag === selector.tag);
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
    /** Opens the machine's stream socket ahead of its first command (a new sandbox's first run then skips it). */
    prepare(machineId: string) {
      tableOf(machineId).catch(() => undefined);
    },
    /** Adds a listener to a running process; returns its pid and the function that removes the listener. */
    async attach(machineId: string, selector: { pid?: number; tag?: string }, listener: Listener): Promise<{ pid: number; detach: () => void }> {
      const { p } = await find(machineId, selector);
      p.listeners.add(listener);
      return { pid: p.pid, detach: () => p.listeners.delete(listener) };
    },
    detach(machineId: string, pid: number, listener: Listener) {
      tables.get(machineId)?.procs.get(pid)?.listeners.delete(listener);
    },
    async list(machineId: string) {
      const t = await tableOf(machineId);
      return [...t.procs.values()].map((p) => ({ pid: p.pid, config: p.config, ...(p.tag !== undefined ? { tag: p.tag } : {}) }));
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
