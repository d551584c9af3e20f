// PTY sessions: a real pseudo-terminal (node-pty) whose output goes to every attached socket and into a 1 MiB
// ring buffer, so a client that reconnects (by session_id or pid) gets what it missed. Sessions outlive sockets,
// and end a grace period after their process exits.

import { randomUUID } from "node:crypto";
import * as nodePty from "@lydell/node-pty";
import type { IPty } from "@lydell/node-pty";
import { constants } from "node:os";
import { processEnv, resolveUser, argvOf, workingDir, checkSpawnRequest } from "./process.ts";
import { raiseOomScore } from "./oom.ts";
import type { StreamServerFrame } from "./protocol.ts";

export const RING_BYTES = 1024 * 1024;
const GRACE_MS = Number(process.env.KILN_AGENT_PTY_GRACE_MS ?? 60_000);

/** What a session needs from a socket attached to it. */
export interface PtySink {
  send(frame: StreamServerFrame): void;
  /** Bytes this sink has not flushed yet; over the high mark the PTY is paused. */
  backlog(): number;
}

const SIGNAL_NAMES = Object.fromEntries(Object.entries(constants.signals).map(([name, n]) => [n, name]));

class Ring {
  private chunks: Buffer[] = [];
  private bytes = 0;
  /** Offset (in the session's whole output) of the first byte still held. */
  start = 0;
  end = 0;

  push(b: Buffer) {
    this.chunks.push(b);
    this.bytes += b.length;
    this.end += b.length;
    // Keep exactly the last RING_BYTES: drop whole chunks, then trim the oldest one.
    while (this.bytes > RING_BYTES) {
      const first = this.chunks[0];
      const excess = this.bytes - RING_BYTES;
      const cut = Math.min(first.length, excess);
      if (cut === first.length) this.chunks.shift();
      else this.chunks[0] = first.subarray(cut);
      this.bytes -= cut;
      this.start += cut;
    }
  }

  /** Everything from `offset` on (clamped to what is held). */
  from(offset: number): { offset: number; data: Buffer } {
    const at = Math.max(offset, this.start);
    const all = Buffer.concat(this.chunks);
    return { offset: at, data: all.subarray(Math.min(all.length, at - this.start)) };
  }
}

export class PtySession {
  readonly id = randomUUID();
  readonly pid: number;
  private readonly pty: IPty;
  private readonly ring = new Ring();
  private readonly sinks = new Set<PtySink>();
  private paused = false;
  exit: { exit_code: number | null; signal: string | null } | undefined;
  private onGone: () => void;
  /** Started with `keep` (the E2B layer): lives on through a resume, listed by kept.list. */
  readonly kept: boolean;
  readonly config: { cmd?: string; args?: string[]; cwd?: string; envs?: Record<string, string>; user?: string; label?: string };

  constructor(
    opts: { cmd?: string; args?: string[]; cwd?: string; envs?: Record<string, string>; user?: string; cols: number; rows: number; keep?: boolean; label?: string },
    onGone: () => void,
  ) {
    checkSpawnRequest(opts);
    this.kept = opts.keep === true;
    this.config = { cmd: opts.cmd, args: opts.args, cwd: opts.cwd, envs: opts.envs, user: opts.user, label: opts.label };
    const user = resolveUser(opts.user);
    const [file, argv] = opts.cmd ? argvOf(opts.cmd, opts.args) : [user.shell || "/bin/sh", ["-l"]];
    this.pty = nodePty.spawn(file, argv, {
      name: "xterm-256color",
      cols: opts.cols,
      rows: opts.rows,
      cwd: workingDir(opts.cwd, user),
      env: processEnv(user, opts.envs, "xterm-256color"),
      uid: user.uid,
      gid: user.gid,
      encoding: null,
    } as nodePty.IPtyForkOptions);
    this.pid = this.pty.pid;
    raiseOomScore(this.pid);
    this.onGone = onGone;
    this.pty.onData((data: string | Buffer) => this.output(typeof data === "string" ? Buffer.from(data) : data));
    this.pty.onExit(({ exitCode, signal }) => {
      this.exit = { exit_code: signal ? null : exitCode, signal: signal ? (SIGNAL_NAMES[signal] ?? String(signal)) : null };
      // Let any output still in flight land before the exit frame.
      setTimeout(() => {
        for (const s of this.sinks) s.send({ type: "pty.exit", session_id: this.id, pid: this.pid, ...this.exit! });
        setTimeout(() => this.end(), GRACE_MS).unref();
      }, 20);
    });
  }

  private output(data: Buffer) {
    const offset = this.ring.end;
    this.ring.push(data);
    const frame: StreamServerFrame = { type: "pty.output", session_id: this.id, pid: this.pid, offset, data_base64: data.toString("base64") };
    for (const s of this.sinks) s.send(frame);
    this.applyBackpressure();
  }

  /** Pauses the PTY while any attached socket is too far behind; resumes when all have caught up. */
  applyBackpressure(high = 1024 * 1024, low = 256 * 1024) {
    let worst = 0;
    for (const s of this.sinks) worst = Math.max(worst, s.backlog());
    if (!this.paused && worst > high) {
      this.paused = true;
      this.pty.pause();
    } else if (this.paused && worst < low) {
      this.paused = false;
      this.pty.resume();
    }
  }

  attach(sink: PtySink) {
    this.sinks.add(sink);
  }

  detach(sink: PtySink) {
    this.sinks.delete(sink);
    this.applyBackpressure();
  }

  /** Replays held output from `offset` to one sink: `truncated` when bytes before it are gone. */
  replay(sink: PtySink, offset: number | undefined, requestId?: string) {
    const from = offset ?? this.ring.start;
    const { offset: at, data } = this.ring.from(from);
    sink.send({ type: "pty.reconnected", ...(requestId ? { request_id: requestId } : {}), session_id: this.id, pid: this.pid, offset: at, ...(from < this.ring.start ? { truncated: true } : {}) });
    for (let i = 0; i < data.length; i += 64 * 1024) {
      const part = data.subarray(i, i + 64 * 1024);
      sink.send({ type: "pty.output", session_id: this.id, pid: this.pid, offset: at + i, data_base64: part.toString("base64") });
    }
    if (this.exit) sink.send({ type: "pty.exit", session_id: this.id, pid: this.pid, ...this.exit });
  }

  input(data: Buffer) {
    if (!this.exit) this.pty.write(data as unknown as string);
  }

  /** Input bytes written to the terminal but not yet taken by the kernel (node-pty queues them on its socket). */
  private get inputSocket(): NodeJS.WritableStream & { writableLength?: number } | undefined {
    return (this.pty as unknown as { _socket?: NodeJS.WritableStream & { writableLength?: number } })._socket;
  }

  inputBacklog(): number {
    return this.exit ? 0 : (this.inputSocket?.writableLength ?? 0);
  }

  /** Calls `cb` once the terminal has taken the queued input (or at once when nothing is queued). */
  onInputDrained(cb: () => void) {
    const socket = this.inputSocket;
    if (!socket || this.inputBacklog() === 0) return cb();
    const done = () => {
      socket.off("drain", done);
      socket.off("close", done);
      cb();
    };
    socket.on("drain", done);
    socket.on("close", done);
  }

  resize(cols: number, rows: number) {
    if (!this.exit) this.pty.resize(cols, rows);
  }

  kill(signal: string = "SIGHUP") {
    if (this.exit) return;
    try {
      process.kill(-this.pid, signal);
    } catch {
      this.pty.kill(signal);
    }
  }

  end() {
    this.kill("SIGKILL");
    this.sinks.clear();
    this.onGone();
  }
}
