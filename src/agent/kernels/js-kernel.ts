// The JavaScript kernel: one Node process per context, run with Kiln's own Node as the machine's user. Code runs in
// this process's global scope (state persists), with top-level await, console captured, and SIGINT as interrupt.
// It speaks the same JSON lines as python_bridge.py: commands on stdin, frames on fd 3 (fd 1/2 stay the user's).

import { writeSync } from "node:fs";
import { createInterface } from "node:readline";
import { Console } from "node:console";
import { EventEmitter } from "node:events";
import { createRequire } from "node:module";
import { inspect } from "node:util";
import { Script } from "node:vm";
import { compileCell } from "./js-cell.ts";

const PROTOCOL_FD = 3;

function emit(frame: Record<string, unknown>) {
  // Whole lines only: a write a signal cut short (SIGINT is the interrupt) goes on from where it stopped.
  const line = Buffer.from(JSON.stringify(frame) + "\n");
  for (let at = 0; at < line.length; ) at += writeSync(PROTOCOL_FD, line, at);
}

/**
 * What the console writes to: a plain writer with no stream state. A Writable whose write an interrupt cut short
 * (breakOnSigint ends the cell mid-call, while the agent paces a slow caller) never called back, and every later
 * console line of the context queued behind it, unseen.
 */
function sink(type: "stdout" | "stderr"): NodeJS.WritableStream {
  const writer = new EventEmitter() as EventEmitter & { write(chunk: string | Uint8Array): boolean };
  writer.write = (chunk) => {
    emit({ type, text: typeof chunk === "string" ? chunk : Buffer.from(chunk).toString("utf8") });
    return true;
  };
  return writer as unknown as NodeJS.WritableStream;
}

const g = globalThis as Record<string, unknown>;
g.console = new Console({ stdout: sink("stdout"), stderr: sink("stderr"), colorMode: false });
g.require = createRequire(`${process.cwd()}/`);

let executionCount = 0;
let interruptPending: ((err: Error) => void) | undefined;

class Interrupted extends Error {
  constructor() {
    super("Execution interrupted");
    this.name = "KeyboardInterrupt";
  }
}

// SIGINT is the interrupt: synchronous code stops through breakOnSigint, a pending await is abandoned here.
process.on("SIGINT", () => interruptPending?.(new Interrupted()));

function display(value: unknown): Record<string, string> {
  return { "text/plain": inspect(value, { colors: false, depth: 4 }) };
}

/** A stack without the kernel's own frames: the user sees their cell, not how it was run. */
function userFrames(stack: string): string {
  return stack
    .split("\n")
    .filter((l) => !/^\s+at .*(node:vm|node:internal|js-kernel|process\.emit|process\.<anonymous>|sigintHandlersWrap)/.test(l))
    .join("\n");
}

/** Sets `envs` in process.env for one execute; returns what puts the previous values back. */
function withEnvs(envs: Record<string, string> | undefined): () => void {
  if (!envs) return () => undefined;
  const saved = Object.keys(envs).map((k) => [k, process.env[k]] as const);
  Object.assign(process.env, envs);
  return () => {
    for (const [k, v] of saved) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  };
}

async function execute(code: string, envs?: Record<string, string>) {
  const count = ++executionCount;
  let status = "ok";
  const restoreEnvs = withEnvs(envs);
  try {
    const cell = compileCell(code);
    let value = new Script(cell.source, { filename: `<cell ${count}>` }).runInThisContext({ breakOnSigint: true, displayErrors: false });
    if (value instanceof Promise) {
      const interrupted = new Promise<never>((_, reject) => (interruptPending = reject));
      value = await Promise.race([value, interrupted]);
    }
    if (value !== undefined) emit({ type: "result", data: display(value), is_main_result: true, execution_count: count });
  } catch (err) {
    status = "error";
    const e = err as { name?: string; message?: string; stack?: string };
    const isError = err instanceof Error || (typeof err === "object" && err !== null && "stack" in err);
    const interrupted = isError && /Script execution was interrupted/.test(String(e.message));
    emit({
      type: "error",
      name: interrupted ? "KeyboardInterrupt" : isError ? (e.name ?? "Error") : "Error",
      value: interrupted ? "Execution interrupted" : isError ? (e.message ?? "") : inspect(err),
      traceback: isError ? userFrames(e.stack ?? String(err)) : `Uncaught ${inspect(err)}`,
    });
  } finally {
    interruptPending = undefined;
    restoreEnvs();
  }
  emit({ type: "done", execution_count: count, status });
}

// A rejection or throw nobody awaited (a timer callback, a forgotten promise) is reported, not fatal.
process.on("uncaughtException", (err) => emit({ type: "stderr", text: `Uncaught ${err?.stack ?? String(err)}\n` }));
process.on("unhandledRejection", (err) => emit({ type: "stderr", text: `Unhandled rejection: ${(err as Error)?.stack ?? inspect(err)}\n` }));

let queue = Promise.resolve();
const lines = createInterface({ input: process.stdin });
lines.on("line", (line) => {
  let cmd: { op?: string; code?: string; envs?: Record<string, string> };
  try {
    cmd = JSON.parse(line);
  } catch {
    return;
  }
  if (cmd.op === "execute") queue = queue.then(() => execute(String(cmd.code ?? ""), cmd.envs));
  else if (cmd.op === "shutdown") process.exit(0);
});
lines.on("close", () => process.exit(0));
emit({ type: "ready", kernel_pid: process.pid });
