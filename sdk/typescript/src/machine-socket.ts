// GET /v1/machines/{id}/ws: streamed execs (stdin in, stdout/stderr out as they come) and PTY sessions that outlive
// a socket — `attachPty` on a new socket replays what was missed from the last offset seen.

import type { KilnOptions } from "./client.ts";
import { KilnApiError } from "./errors.ts";
import type { ServerFrame } from "./frames.ts";
import { openFrameSocket, requestId } from "./socket.ts";
import type { FrameSocket } from "./socket.ts";

export interface ExecOptions {
  /** With args, `cmd` is the program; without, a shell line for /bin/sh -c. */
  args?: string[];
  cwd?: string;
  envs?: Record<string, string>;
  user?: string;
  stdin?: boolean;
  onStdout?: (data: Uint8Array) => void;
  onStderr?: (data: Uint8Array) => void;
}

export interface ExecResult {
  exit_code: number | null;
  signal: string | null;
}

export interface ExecHandle {
  pid: number;
  write(data: string | Uint8Array): void;
  closeStdin(): void;
  signal(signal: string): void;
  /** Resolves when the process ends. */
  wait(): Promise<ExecResult>;
}

export interface PtyOptions {
  cols: number;
  rows: number;
  cmd?: string;
  args?: string[];
  cwd?: string;
  envs?: Record<string, string>;
  user?: string;
  onData: (data: Uint8Array, offset: number) => void;
}

export interface PtySession {
  sessionId: string;
  pid: number;
  /** Offset just past the last byte received: attach from here after a lost socket. */
  readonly offset: number;
  write(data: string | Uint8Array): void;
  resize(cols: number, rows: number): void;
  kill(signal?: string): void;
  /** Resolves when the PTY's process ends (not when this socket closes). */
  exited: Promise<ExecResult>;
}

const bytes = (b64: string) => Uint8Array.from(Buffer.from(b64, "base64"));
const b64 = (data: string | Uint8Array) => Buffer.from(data).toString("base64");

/** Waits for the first frame answering `request_id`; an `error` frame for it rejects with its code and message. */
function answer<T extends ServerFrame["type"]>(socket: FrameSocket, id: string, type: T): Promise<Extract<ServerFrame, { type: T }>> {
  return new Promise((resolve, reject) => {
    socket.on((f) => {
      if (!("request_id" in f) || f.request_id !== id) return false;
      if (f.type === "error") reject(new KilnApiError(400, { code: f.code, error: f.error }));
      else if (f.type === type) resolve(f as Extract<ServerFrame, { type: T }>);
      else return false;
      return true;
    });
    void socket.closed.then(() => reject(new KilnApiError(0, undefined, "the machine socket closed")));
  });
}

export class MachineSocket {
  private readonly socket: FrameSocket;
  readonly machineId: string;

  private constructor(socket: FrameSocket, machineId: string) {
    this.socket = socket;
    this.machineId = machineId;
  }

  static async open(opts: KilnOptions, machineId: string): Promise<MachineSocket> {
    return new MachineSocket(await openFrameSocket(opts, `v1/machines/${encodeURIComponent(machineId)}/ws`), machineId);
  }

  /** Starts a process; its output goes to the callbacks as it comes. */
  async exec(cmd: string, opts: ExecOptions = {}): Promise<ExecHandle> {
    const id = requestId();
    const { onStdout, onStderr, stdin, ...rest } = opts;
    this.socket.send({ type: "exec.start", request_id: id, cmd, ...rest, ...(stdin ? { stdin: true } : {}) });
    const { pid } = await answer(this.socket, id, "exec.started");
    const exited = new Promise<ExecResult>((resolve, reject) => {
      this.socket.on((f) => {
        if (!("pid" in f) || f.pid !== pid) return false;
        if (f.type === "exec.stdout") onStdout?.(bytes(f.data_base64));
        else if (f.type === "exec.stderr") onStderr?.(bytes(f.data_base64));
        else if (f.type === "exec.exit") {
          resolve({ exit_code: f.exit_code, signal: f.signal });
          return true;
        }
        return false;
      });
      void this.socket.closed.then(() => reject(new KilnApiError(0, undefined, "the machine socket closed before the process ended")));
    });
    exited.catch(() => undefined);
    return {
      pid,
      write: (data) => this.socket.send({ type: "exec.stdin", pid, data_base64: b64(data) }),
      closeStdin: () => this.socket.send({ type: "exec.stdin", pid, eof: true }),
      signal: (signal) => this.socket.send({ type: "exec.signal", pid, signal }),
      wait: () => exited,
    };
  }

  /** Starts a PTY session. */
  async pty(opts: PtyOptions): Promise<PtySession> {
    const id = requestId();
    const { onData, ...rest } = opts;
    this.socket.send({ type: "pty.start", request_id: id, ...rest });
    const started = await answer(this.socket, id, "pty.started");
    return this.follow(started.session_id, started.pid, 0, onData);
  }

  /**
   * Attaches to a PTY session started on another (perhaps lost) socket, replaying its output from `offset` (what a
   * session's `offset` said last); bytes already gone from the server's ring are skipped, `truncated` says so.
   */
  async attachPty(sessionId: string, offset: number, onData: PtyOptions["onData"]): Promise<PtySession & { truncated: boolean }> {
    const id = requestId();
    // Listen before asking: the replay follows the answer at once.
    const session = this.follow(sessionId, 0, offset, onData);
    this.socket.send({ type: "pty.reconnect", request_id: id, session_id: sessionId, offset });
    const back = await answer(this.socket, id, "pty.reconnected");
    return Object.assign(session, { pid: back.pid, truncated: back.truncated === true });
  }

  private follow(sessionId: string, pid: number, from: number, onData: PtyOptions["onData"]): PtySession {
    const socket = this.socket;
    let offset = from;
    const exited = new Promise<ExecResult>((resolve, reject) => {
      socket.on((f) => {
        if (!("session_id" in f) || f.session_id !== sessionId) return false;
        if (f.type === "pty.output") {
          const data = bytes(f.data_base64);
          // A replay may start before what was already seen: hand on only the new bytes.
          const skip = Math.max(0, offset - f.offset);
          if (skip < data.length) onData(data.subarray(skip), f.offset + skip);
          offset = Math.max(offset, f.offset + data.length);
        } else if (f.type === "pty.exit") {
          resolve({ exit_code: f.exit_code, signal: f.signal });
          return true;
        }
        return false;
      });
      void socket.closed.then(() => reject(new KilnApiError(0, undefined, "the machine socket closed (the session goes on: attach again)")));
    });
    exited.catch(() => undefined);
    return {
      sessionId,
      pid,
      get offset() {
        return offset;
      },
      write: (data) => socket.send({ type: "pty.input", session_id: sessionId, data_base64: b64(data) }),
      resize: (cols, rows) => socket.send({ type: "pty.resize", session_id: sessionId, cols, rows }),
      kill: (signal) => socket.send({ type: "pty.kill", session_id: sessionId, ...(signal ? { signal } : {}) }),
      exited,
    };
  }

  close(): Promise<number> {
    this.socket.close();
    return this.socket.closed;
  }
}
