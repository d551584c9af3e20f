// Kept processes: exec processes that outlive the socket that started them. Only a start that asks for it
// (exec.start with `keep: true`, which the E2B layer sets: envd's commands outlive every connection) is kept;
// native exec processes still belong to their socket and end with it (SPEC.md). A kept process's output goes to
// every attached socket and into a bounded ring (offsets count its whole output), so a socket opened later (after
// a pause and resume, or a server restart) re-attaches by pid and gets what it missed. A kept process is reaped a
// grace period after it exits, and killed with the agent (the machine's destroy ends the agent and all it started).

import type { ChildProcess } from "node:child_process";
import { spawnAs } from "./process.ts";
import { signalTree } from "./process-tree.ts";
import { exitOf, oomKills } from "./oom.ts";
import { AgentFailure } from "./errors.ts";
import type { StreamServerFrame } from "./protocol.ts";

/** Output held per kept process (stdout and stderr together); older bytes leave first. */
export const KEPT_RING_BYTES = 1024 * 1024;
/** Kept processes (and kept PTY sessions) one machine may hold at once, exited ones in their grace included. */
export const KEPT_MAX = 64;
/** Longest label a start may attach (the E2B layer's tag). */
export const KEPT_LABEL_MAX = 1024;
const GRACE_MS = Number(process.env.KILN_AGENT_KEPT_GRACE_MS ?? 60_000);
const HIGH_WATER = 1024 * 1024;
const LOW_WATER = 256 * 1024;

export interface KeptSink {
  send(frame: StreamServerFrame): void;
  backlog(): number;
}

export interface KeptConfig {
  cmd: string;
  args?: string[];
  cwd?: string;
  envs?: Record<string, string>;
  user?: string;
  label?: string;
}

type Chunk = { stream: "stdout" | "stderr"; offset: number; data: Buffer };

/** The last KEPT_RING_BYTES of a process's output, each chunk tagged with its stream and its offset. */
class OutputRing {
  private chunks: Chunk[] = [];
  private bytes = 0;
  start = 0;
  end = 0;

  push(stream: Chunk["stream"], data: Buffer): number {
    const offset = this.end;
    this.chunks.push({ stream, offset, data });
    this.bytes += data.length;
    this.end += data.length;
    while (this.bytes > KEPT_RING_BYTES) {
      const first = this.chunks[0];
      const cut = Math.min(first.data.length, this.bytes - KEPT_RING_BYTES);
      if (cut === first.data.length) this.chunks.shift();
      else this.chunks[0] = { stream: first.stream, offset: first.offset + cut, data: first.data.subarray(cut) };
      this.bytes -= cut;
      this.start += cut;
    }
    return offset;
  }

  /** The chunks from `offset` on (clamped to what is held). */
  from(offset: number): Chunk[] {
    const at = Math.max(offset, this.start);
    const out: Chunk[] = [];
    for (const c of this.chunks) {
      const endOf = c.offset + c.data.length;
      if (endOf <= at) continue;
      out.push(c.offset >= at ? c : { stream: c.stream, offset: at, data: c.data.subarray(at - c.offset) });
    }
    return out;
  }
}

const kept = new Map<number, KeptProcess>();

export class KeptProcess {
  readonly pid: number;
  readonly config: KeptConfig;
  private readonly child: ChildProcess;
  private readonly ring = new OutputRing();
  private readonly sinks = new Set<KeptSink>();
  private paused = false;
  exit: { exit_code: number | null; signal: string | null; oom_killed?: true } | undefined;

  constructor(child: ChildProcess, config: KeptConfig, oomBefore: number | undefined) {
    this.child = child;
    this.pid = child.pid!;
    this.config = config;
    child.stdin?.on("error", () => undefined);
    this.pipe(child.stdout!, "stdout");
    this.pipe(child.stderr!, "stderr");
    child.on("close", (code, signal) => {
      this.exit = exitOf(code, signal, config.args === undefined, oomBefore);
      for (const s of this.sinks) s.send({ type: "exec.exit", pid: this.pid, ...this.exit });
      setTimeout(() => this.forget(), GRACE_MS).unref();
    });
  }

  private pipe(stream: NodeJS.ReadableStream, name: "stdout" | "stderr") {
    stream.on("data", (b: Buffer) => {
      const offset = this.ring.push(name, b);
      const frame: StreamServerFrame = { type: name === "stdout" ? "exec.stdout" : "exec.stderr", pid: this.pid, offset, data_base64: b.toString("base64") };
      for (const s of this.sinks) s.send(frame);
      this.applyBackpressure();
    });
  }

  /** Pauses the pipes while an attached socket is far behind; with no socket attached the ring takes everything. */
  applyBackpressure() {
    let worst = 0;
    for (const s of this.sinks) worst = Math.max(worst, s.backlog());
    const pause = this.paused ? worst >= LOW_WATER : worst > HIGH_WATER;
    if (pause === this.paused) return;
    this.paused = pause;
    for (const s of [this.child.stdout, this.child.stderr]) {
      if (pause) s?.pause();
      else s?.resume();
    }
  }

  attach(sink: KeptSink) {
    this.sinks.add(sink);
  }

  detach(sink: KeptSink) {
    this.sinks.delete(sink);
    this.applyBackpressure();
  }

  /** Replays held output from `offset` (default: the oldest byte held), then the exit if it came. */
  replay(sink: KeptSink, offset: number | undefined, requestId?: string) {
    const from = offset ?? this.ring.start;
    const chunks = this.ring.from(from);
    const at = Math.max(from, this.ring.start);
    sink.send({ type: "exec.attached", ...(requestId ? { request_id: requestId } : {}), pid: this.pid, offset: at, ...(from < this.ring.start ? { truncated: true } : {}) });
    for (const c of chunks) {
      for (let i = 0; i < c.data.length; i += 64 * 1024) {
        sink.send({ type: c.stream === "stdout" ? "exec.stdout" : "exec.stderr", pid: this.pid, offset: c.offset + i, data_base64: c.data.subarray(i, i + 64 * 1024).toString("base64") });
      }
    }
    if (this.exit) sink.send({ type: "exec.exit", pid: this.pid, ...this.exit });
  }

  get stdin(): NodeJS.WritableStream | null {
    return this.exit ? null : this.child.stdin;
  }

  get hasStdin(): boolean {
    return this.child.stdin !== null;
  }

  /** Signals the whole tree; a process that already exited is not signalled (its pid may be someone else's now). */
  signal(sig: NodeJS.Signals) {
    if (!this.exit) signalTree(this.child, sig);
  }

  private forget() {
    if (kept.get(this.pid) === this) kept.delete(this.pid);
    this.sinks.clear();
  }

  end() {
    this.signal("SIGKILL");
    this.forget();
  }
}

/**
 * Starts a kept process; `othersKept` counts the kept PTY sessions, which share the bound. At the bound, exited
 * processes still in their grace make room (oldest first); if every one is running, the start is refused.
 */
export function startKept(config: KeptConfig, opts: { stdin: boolean; othersKept: number }, onSpawn: (p: KeptProcess) => void): ChildProcess {
  makeRoom(opts.othersKept);
  const oomBefore = oomKills();
  const child = spawnAs(config, { stdin: opts.stdin });
  // No pid: the spawn failed, and the child's "error" event says why (the caller listens for it).
  if (child.pid === undefined) return child;
  // Registered before any output can be read: the pipes are read from the next turn of the event loop.
  const p = new KeptProcess(child, config, oomBefore);
  kept.get(p.pid)?.end(); // an exited one whose pid came round again
  kept.set(p.pid, p);
  child.once("spawn", () => onSpawn(p));
  return child;
}

/** Throws `conflict` when the machine keeps KEPT_MAX processes already, after dropping exited ones if needed. */
export function makeRoom(othersKept: number) {
  if (kept.size + othersKept < KEPT_MAX) return;
  for (const p of [...kept.values()]) {
    if (kept.size + othersKept < KEPT_MAX) break;
    if (p.exit) p.end();
  }
  if (kept.size + othersKept >= KEPT_MAX) {
    throw new AgentFailure("conflict", `This machine already keeps ${KEPT_MAX} background processes; end one before starting another`);
  }
}

export function findKept(pid: unknown): KeptProcess | undefined {
  return typeof pid === "number" ? kept.get(pid) : undefined;
}

export function keptProcesses(): KeptProcess[] {
  return [...kept.values()];
}

/** Ends every kept process (the agent is stopping). */
export function endAllKept(): number {
  const n = kept.size;
  for (const p of [...kept.values()]) p.end();
  return n;
}
