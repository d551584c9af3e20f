// Running a builder's commands: output read as lines (long ones in pieces) into the build log, reading paused while
// the log's store is behind, cancel and timeouts killing the command (or the whole build sandbox), and a failure
// phrased as a build_error with the command's last lines. The step and build timeouts are kept here too.

import { spawn } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { BuildFailure } from "../failure.ts";
import { importError } from "../oci/types.ts";
import type { Sandbox } from "./isolation/sandbox.ts";

/** Builder output lines longer than this reach the log in pieces (a RUN printing one endless line cannot grow memory). */
const MAX_LINE = 16 * 1024;

/** The step and build timeouts: which one fired (if any), and what to do when one does. */
export interface Guard {
  /** A builder output line: a `STEP n/m:` line starts the next step's clock. */
  line(text: string): void;
  /** What a timeout kills: the command running when it fires (each command registers itself). */
  onExpire(kill: () => void): void;
  /** Throws the timeout's build_error if one fired. */
  check(): void;
  stop(): void;
}

export function createGuard(stepMs: number, buildMs: number): Guard {
  let expired: BuildFailure | undefined;
  let kill: (() => void) | undefined;
  let step = "";
  const fire = (message: string) => {
    expired ??= new BuildFailure(message, { phase: "step", retryable: false, suggestedAction: "make the step faster or split it; the limits are KILN_BUILD_STEP_TIMEOUT_S and KILN_BUILD_TIMEOUT_S" });
    kill?.();
  };
  const whole = setTimeout(() => fire(`the Dockerfile build ran longer than ${buildMs / 1000} s and was stopped`), buildMs);
  let stepTimer = setTimeout(() => fire(`a step ran longer than ${stepMs / 1000} s and was stopped`), stepMs);
  return {
    line(text) {
      const m = /^(?:\[\d+\/\d+\] )?STEP (\d+\/\d+): /.exec(text);
      if (!m) return;
      step = `${m[1]} (${text.slice(m[0].length, m[0].length + 80)})`;
      clearTimeout(stepTimer);
      stepTimer = setTimeout(() => fire(`step ${step} ran longer than ${stepMs / 1000} s and was stopped`), stepMs);
    },
    onExpire(k) {
      kill = k;
      if (expired) k();
    },
    check() {
      if (expired) throw expired;
    },
    stop() {
      clearTimeout(whole);
      clearTimeout(stepTimer);
    },
  };
}

export interface RunOptions {
  env: NodeJS.ProcessEnv;
  onLine: (line: string) => void;
  /** Builder commands run inside the build's sandbox; cancel and timeouts kill the whole sandbox. */
  sandbox?: Sandbox;
  signal?: AbortSignal;
  /** The command's stdout is its answer (an id, a path): kept, up to 64 KiB. */
  keepStdout?: boolean;
  backpressure?: () => Promise<void> | undefined;
  guard?: Guard;
}

/** Runs a builder command; its output goes to `onLine` line by line. A failure becomes a build_error with its tail. */
export function run(cmd: string, args: string[], o: RunOptions): Promise<string> {
  return new Promise((resolvePromise, reject) => {
    if (o.signal?.aborted) return reject(importError("the build was cancelled"));
    const child: ChildProcess = o.sandbox ? o.sandbox.spawn(cmd, args, o.env) : spawn(cmd, args, { env: o.env, stdio: ["ignore", "pipe", "pipe"] });
    const stop = () => (o.sandbox ? void o.sandbox.kill() : child.kill("SIGKILL"));
    o.signal?.addEventListener("abort", stop, { once: true });
    // A timeout kills what runs now: the whole sandbox, or this command (buildctl: the daemon's own work is its own).
    o.guard?.onExpire(stop);
    let stdout = "";
    let tail = "";
    let partial = "";
    const emit = (l: string) => {
      if (!l.trim()) return;
      o.onLine(l.trimEnd());
    };
    const feed = (chunk: Buffer, keep: boolean) => {
      const s = chunk.toString();
      if (keep && o.keepStdout && stdout.length < 65_536) stdout += s;
      tail = (tail + s).slice(-2000);
      const lines = (partial + s).split("\n");
      partial = lines.pop() ?? "";
      for (const l of lines) for (let i = 0; i < l.length || i === 0; i += MAX_LINE) emit(l.slice(i, i + MAX_LINE));
      while (partial.length > MAX_LINE) {
        emit(partial.slice(0, MAX_LINE));
        partial = partial.slice(MAX_LINE);
      }
      // The log's store is behind: stop reading, so the builder (and the RUN printing) waits on a full pipe.
      const wait = o.backpressure?.();
      if (wait) {
        child.stdout!.pause();
        child.stderr!.pause();
        void wait.then(() => {
          child.stdout!.resume();
          child.stderr!.resume();
        });
      }
    };
    child.stdout!.on("data", (c: Buffer) => feed(c, true));
    child.stderr!.on("data", (c: Buffer) => feed(c, false));
    child.on("error", (e) => reject(importError(`${cmd} could not run: ${e.message}`)));
    child.on("close", (code) => {
      o.signal?.removeEventListener("abort", stop);
      if (partial.trim()) emit(partial);
      if (code === 0) resolvePromise(stdout);
      else if (o.signal?.aborted) reject(importError("the build was cancelled"));
      else reject(importError(`the Dockerfile build failed: ${cmd} exited ${code}: ${lastLines(tail)}`));
    });
  });
}

function lastLines(text: string): string {
  return text.trim().split("\n").slice(-3).join(" | ");
}
