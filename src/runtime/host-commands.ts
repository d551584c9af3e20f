// The host commands a machine's boot and teardown run (mount, mkfs, nft, the OCI runtime, slirp4netns, umount) are
// started by a small helper process, not by the server. Node starts a child with fork(): the kernel copies the
// parent's page tables, and the parent's thread waits until the child has exec'd. The server's heap makes that
// ≈ 10–15 ms of its main thread per command (measured: a 250 MiB process blocks 15 ms per spawn, a 48 MiB one
// 0.8 ms), and a cold boot runs four or five of them: a burst of 20 creates spent 776 ms of a 3 s burst with the
// server's only thread stuck in spawn (CPU profile of the server, docs/hot-pools.md "Bursts of cold boots").
// The helper is forked once, lazily, keeps no state between requests and exits when the server does. Should it die,
// what it was running fails like a command that failed, and the next command starts a new one.

import { fork } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import type { Server } from "node:net";

/** What becomes of one of the command's stdio fds: nothing, a pipe, a file appended to, or the listening socket passed. */
export type HostStdio = "ignore" | "pipe" | "handle" | { append: string };

export interface HostCommandRequest {
  id: number;
  file: string;
  args: string[];
  stdio: HostStdio[];
  detached?: boolean;
  input?: string;
  maxBuffer: number;
  timeoutMs?: number;
  /** Answer (and let go of the command) once this fd, a pipe, has data: a daemon that says it is ready. */
  readyFd?: number;
}

export interface HostCommandReply {
  id: number;
  pid?: number;
  ready?: boolean;
  code?: number | null;
  signal?: NodeJS.Signals | null;
  /** Killed at its timeout. */
  killed?: boolean;
  stdout?: string;
  stderr?: string;
  error?: { message: string; code?: string };
}

const CHILD = new URL("./host-commands-child.ts", import.meta.url);
const DEFAULT_MAX_BUFFER = 1024 * 1024;

let helper: ChildProcess | undefined;
let seq = 0;
const pending = new Map<number, (r: HostCommandReply) => void>();

function start(): ChildProcess {
  // No inherited execArgv (an inspector or profiler flag of the server's would apply to it too); a small heap.
  const child = fork(CHILD, [], { execArgv: ["--max-old-space-size=64"], stdio: ["ignore", "inherit", "inherit", "ipc"], serialization: "json" });
  child.on("message", (r: HostCommandReply) => {
    const done = pending.get(r.id);
    if (!done) return;
    pending.delete(r.id);
    done(r);
    if (pending.size === 0) idle(child);
  });
  child.once("exit", (code, signal) => {
    if (helper === child) helper = undefined;
    for (const [id, done] of pending) done({ id, error: { message: `the host command helper exited (${code ?? signal}) before answering` } });
    pending.clear();
  });
  child.on("error", () => undefined); // an exit follows; a send to a dead helper is answered by it
  return child;
}

/** A helper with nothing in flight keeps neither itself nor its channel referenced: it never holds the server's exit. */
function idle(child: ChildProcess) {
  child.unref();
  (child.channel as unknown as { unref?(): void } | undefined)?.unref?.();
}

function busy(child: ChildProcess) {
  child.ref();
  (child.channel as unknown as { ref?(): void } | undefined)?.ref?.();
}

function request(req: Omit<HostCommandRequest, "id">, handle?: Server): Promise<HostCommandReply> {
  helper ??= start();
  const child = helper;
  const id = ++seq;
  return new Promise((resolve) => {
    pending.set(id, resolve);
    busy(child);
    child.send({ ...req, id }, handle, (err) => {
      if (!err || !pending.has(id)) return;
      pending.delete(id);
      resolve({ id, error: { message: `the host command helper could not be reached: ${err.message}` } });
    });
  });
}

type ExecError = Error & { code?: number | string | null; signal?: NodeJS.Signals | null; killed?: boolean; stdout?: string; stderr?: string };

function failure(file: string, args: string[], r: HostCommandReply): ExecError {
  if (r.error) return Object.assign(new Error(`${file}: ${r.error.message}`), { code: r.error.code, stdout: r.stdout ?? "", stderr: r.stderr ?? "" });
  return Object.assign(new Error(`Command failed: ${[file, ...args].join(" ")}\n${r.stderr ?? ""}`), { code: r.code, signal: r.signal, killed: r.killed === true, stdout: r.stdout ?? "", stderr: r.stderr ?? "" });
}

/**
 * As promisified `execFile`: resolves with the output of a command that exited 0, rejects with an error carrying
 * `code`, `signal`, `stdout` and `stderr` otherwise. `input` is written to its stdin. Output (stdout and stderr
 * together) is bounded by `maxBuffer` (1 MiB unless given): a command that prints more is ended (SIGTERM) and the
 * call rejects with code ERR_CHILD_PROCESS_STDIO_MAXBUFFER, as execFile's; nothing past the cap is kept.
 */
export async function execHost(file: string, args: string[], opts: { timeout?: number; maxBuffer?: number; input?: string } = {}): Promise<{ stdout: string; stderr: string }> {
  const r = await request({ file, args, stdio: [opts.input === undefined ? "ignore" : "pipe", "pipe", "pipe"], input: opts.input, maxBuffer: opts.maxBuffer ?? DEFAULT_MAX_BUFFER, timeoutMs: opts.timeout });
  if (r.error || r.code !== 0) throw failure(file, args, r);
  return { stdout: r.stdout ?? "", stderr: r.stderr ?? "" };
}

/** Runs a command to its exit with its output appended to `log`, `listener` (if any) as its fd 3. */
export async function runHost(file: string, args: string[], opts: { log: string; listener?: Server }): Promise<{ code: number | null; signal: NodeJS.Signals | null }> {
  const stdio: HostStdio[] = ["ignore", { append: opts.log }, { append: opts.log }];
  if (opts.listener) stdio.push("handle");
  const r = await request({ file, args, stdio, maxBuffer: DEFAULT_MAX_BUFFER }, opts.listener);
  if (r.error) throw Object.assign(new Error(r.error.message), { code: r.error.code });
  return { code: r.code ?? null, signal: r.signal ?? null };
}

/**
 * Starts a daemon detached, its output appended to `log`, and resolves with its pid once it writes to its fd 3; it is
 * killed if it has not within `timeoutMs`. Rejects if it exits first.
 */
export async function startDaemon(file: string, args: string[], opts: { log: string; timeoutMs: number }): Promise<number> {
  const r = await request({ file, args, stdio: ["ignore", { append: opts.log }, { append: opts.log }, "pipe"], detached: true, readyFd: 3, maxBuffer: DEFAULT_MAX_BUFFER, timeoutMs: opts.timeoutMs });
  if (r.ready && r.pid) return r.pid;
  if (r.error) throw Object.assign(new Error(r.error.message), { code: r.error.code });
  throw Object.assign(new Error(`exited ${r.code ?? r.signal} before it was ready`), { code: r.code, signal: r.signal });
}
