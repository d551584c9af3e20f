// The `kiln` CLI as a person runs it against a test server: with pipes (a script) or under a pseudo-terminal (a
// person at a terminal), with waits on what it printed rather than on the clock.

import { spawn } from "node:child_process";
import { join } from "node:path";
import * as pty from "@lydell/node-pty";
import { TEST_KEY } from "./kiln.ts";

export const KILN_BIN = join(import.meta.dirname, "..", "..", "bin", "kiln");

export interface CliRun {
  stdout(): string;
  stderr(): string;
  /** Resolves when what was printed so far (stdout, or the terminal) matches; rejects after `ms`. */
  waitFor(pattern: RegExp, ms?: number): Promise<void>;
  write(data: string | Buffer): void;
  end(): void;
  exited: Promise<number | null>;
  /** Whether the process has exited yet. */
  done(): boolean;
}

function waiter(read: () => string, onChange: (cb: () => void) => void, what: () => string) {
  return (pattern: RegExp, ms = 30_000) =>
    new Promise<void>((resolve, reject) => {
      if (pattern.test(read())) return resolve();
      const timer = setTimeout(() => reject(new Error(`no ${pattern} within ${ms} ms; got ${JSON.stringify(what())}`)), ms);
      onChange(() => {
        if (pattern.test(read())) {
          clearTimeout(timer);
          resolve();
        }
      });
    });
}

/** Runs `kiln …` with pipes for stdin, stdout and stderr. */
export function cliPipes(url: string, args: string[], env: Record<string, string> = {}): CliRun {
  const child = spawn(KILN_BIN, args, { env: { ...process.env, KILN_URL: url, KILN_API_KEY: TEST_KEY, ...env }, stdio: ["pipe", "pipe", "pipe"] });
  const out: Buffer[] = [];
  const err: Buffer[] = [];
  const listeners: (() => void)[] = [];
  const notify = () => listeners.forEach((l) => l());
  child.stdout.on("data", (b: Buffer) => (out.push(b), notify()));
  child.stderr.on("data", (b: Buffer) => (err.push(b), notify()));
  child.stdin.on("error", () => undefined);
  let finished = false;
  const exited = new Promise<number | null>((resolve) => child.on("close", (code) => ((finished = true), resolve(code))));
  const stdout = () => Buffer.concat(out).toString();
  return {
    stdout,
    stderr: () => Buffer.concat(err).toString(),
    waitFor: waiter(stdout, (cb) => listeners.push(cb), () => stdout() + Buffer.concat(err).toString()),
    write: (d) => child.stdin.write(d),
    end: () => child.stdin.end(),
    exited,
    done: () => finished,
  };
}

/** Runs `kiln …` under a pseudo-terminal: stdout and stderr both arrive on the terminal. */
export function cliPty(url: string, args: string[], env: Record<string, string> = {}): CliRun {
  const term = pty.spawn(KILN_BIN, args, { name: "xterm", cols: 100, rows: 30, env: { ...process.env, KILN_URL: url, KILN_API_KEY: TEST_KEY, ...env } as Record<string, string> });
  let text = "";
  const listeners: (() => void)[] = [];
  term.onData((d) => {
    text += d;
    listeners.forEach((l) => l());
  });
  let finished = false;
  const exited = new Promise<number | null>((resolve) => term.onExit(({ exitCode }) => ((finished = true), resolve(exitCode))));
  return {
    stdout: () => text,
    stderr: () => text,
    waitFor: waiter(() => text, (cb) => listeners.push(cb), () => text),
    write: (d) => term.write(typeof d === "string" ? d : d.toString()),
    end: () => term.write("\x04"),
    exited,
    done: () => finished,
  };
}
