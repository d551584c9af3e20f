// Starting processes inside the machine the way every feature needs them: as a named user from the machine's own
// passwd, with a clean environment (machine defaults + request envs, nothing of the agent's own), in their own
// process group so a timeout or signal reaches the whole tree — and, when that is not enough (setsid, daemons),
// every descendant and every process still holding the exec's pipes. Everything started here is the OOM killer's
// first choice, never the agent.

import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import type { ChildProcess } from "node:child_process";
import { constants } from "node:os";
import { lookupUser } from "./users.ts";
import { AgentFailure } from "./errors.ts";
import { CHILD_OOM_SCORE_ADJ, exitOf, oomKills, raiseOomScore } from "./oom.ts";
import { rememberSpawn, signalTree } from "./process-tree.ts";
import type { ExecRequest, ExecResult, UserInfo } from "./protocol.ts";

const BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const OUTPUT_CAP = 16 * 1024 * 1024;
/** After a kill, how long to wait for the direct child to be reaped before answering anyway. */
const REAP_GRACE_MS = 2000;
const ENV_NAME = /^[A-Za-z_][A-Za-z0-9_]*$/;

/** Create-time envs of the machine (PUT /envs), held only in this process's memory. */
let machineEnvs: Record<string, string> = {};

export function setMachineEnvs(envs: Record<string, string>) {
  machineEnvs = { ...envs };
}

export function resolveUser(name: string | undefined): UserInfo {
  const user = lookupUser(name ?? "root");
  if (!user) throw new AgentFailure("invalid_request", `No user ${JSON.stringify(name)} in /etc/passwd`);
  return user;
}

export function processEnv(user: UserInfo, extra: Record<string, string> | undefined, term?: string): Record<string, string> {
  return {
    PATH: BASE_PATH,
    HOME: user.home,
    USER: user.name,
    LOGNAME: user.name,
    SHELL: user.shell,
    LANG: "C.UTF-8",
    ...(term ? { TERM: term } : {}),
    ...machineEnvs,
    ...extra,
  };
}

/**
 * argv for a request: a shell line through /bin/sh -c, or the program and its args. The shell first raises its
 * own OOM score, so everything the line starts inherits it from the first fork (the agent's write after spawn
 * could come after that); errors of that step are silent.
 */
export function argvOf(cmd: string, args: string[] | undefined): [string, string[]] {
  return args === undefined ? ["/bin/sh", ["-c", `echo ${CHILD_OOM_SCORE_ADJ} 2>/dev/null >/proc/self/oom_score_adj; ${cmd}`]] : [cmd, args];
}

export interface SpawnRequest {
  cmd: string;
  args?: string[];
  cwd?: string;
  envs?: Record<string, string>;
  user?: string;
}

/** The working directory to use: the one asked for (which must exist), else the user's home, else /. */
export function workingDir(cwd: string | undefined, user: UserInfo): string {
  if (cwd !== undefined) {
    if (!existsSync(cwd)) throw new AgentFailure("invalid_request", `The working directory ${cwd} does not exist`);
    return cwd;
  }
  return existsSync(user.home) ? user.home : "/";
}

/**
 * Refuses what the kernel cannot take (a NUL ends a C string) and env names that are not POSIX, as
 * invalid_request: the control plane checks the same at its edge, the agent never crashes on it either.
 */
export function checkSpawnRequest(req: { cmd?: unknown; args?: unknown; cwd?: unknown; envs?: unknown; user?: unknown }) {
  const bad = (what: string) => {
    throw new AgentFailure("invalid_request", `${what} must not contain a NUL byte`);
  };
  if (typeof req.cmd === "string" && req.cmd.includes("\0")) bad("cmd");
  if (Array.isArray(req.args) && req.args.some((a) => typeof a !== "string" || a.includes("\0"))) bad("args");
  if (typeof req.cwd === "string" && req.cwd.includes("\0")) bad("cwd");
  if (typeof req.user === "string" && req.user.includes("\0")) bad("user");
  if (req.envs !== undefined && req.envs !== null) {
    if (typeof req.envs !== "object") throw new AgentFailure("invalid_request", "envs must map names to strings");
    for (const [k, v] of Object.entries(req.envs)) {
      if (!ENV_NAME.test(k)) throw new AgentFailure("invalid_request", `${JSON.stringify(k.slice(0, 64))} is not a valid environment variable name`);
      if (typeof v !== "string" || v.includes("\0")) throw new AgentFailure("invalid_request", `envs.${k} must be a string without NUL bytes`);
    }
  }
}

export function spawnAs(req: SpawnRequest, opts: { stdin: boolean }): ChildProcess {
  checkSpawnRequest(req);
  const user = resolveUser(req.user);
  const [file, argv] = argvOf(req.cmd, req.args);
  const child = spawn(file, argv, {
    cwd: workingDir(req.cwd, user),
    env: processEnv(user, req.envs),
    uid: user.uid,
    gid: user.gid,
    detached: true, // own process group: kill(-pid) reaches everything it started
    stdio: [opts.stdin ? "pipe" : "ignore", "pipe", "pipe"],
  });
  // A shell line raises its own score before its first command (see argvOf); a program is raised from here.
  if (req.args !== undefined) raiseOomScore(child.pid);
  rememberSpawn(child, user);
  return child;
}
export function signalName(signal: NodeJS.Signals | null): string | null {
  return signal ?? null;
}

export function isSignal(name: string): name is NodeJS.Signals {
  const n = name.startsWith("SIG") ? name : `SIG${name}`;
  return n in constants.signals;
}

/**
 * One-shot exec: runs to completion and returns exit status and both outputs. At the timeout (or when `abort`
 * fires: the caller went away) everything the command started is killed and the answer comes at once, without
 * waiting for pipes that some escaped process might still hold.
 */
export function execOnce(req: ExecRequest, abort?: AbortSignal): Promise<ExecResult> {
  const started = performance.now();
  return new Promise((resolve, reject) => {
    let child: ChildProcess;
    const oomBefore = oomKills();
    try {
      child = spawnAs(req, { stdin: req.stdin_base64 !== undefined });
    } catch (err) {
      return reject(err);
    }
    const out: Buffer[] = [];
    const err: Buffer[] = [];
    let outLen = 0;
    let errLen = 0;
    let timedOut = false;
    let done = false;
    child.stdout!.on("data", (b: Buffer) => {
      if (outLen < OUTPUT_CAP) out.push(b.subarray(0, OUTPUT_CAP - outLen));
      outLen += b.length;
    });
    child.stderr!.on("data", (b: Buffer) => {
      if (errLen < OUTPUT_CAP) err.push(b.subarray(0, OUTPUT_CAP - errLen));
      errLen += b.length;
    });
    if (req.stdin_base64 !== undefined) {
      child.stdin!.on("error", () => undefined); // a command that does not read its stdin
      child.stdin!.end(Buffer.from(req.stdin_base64, "base64"));
    }
    const finish = (code: number | null, signal: NodeJS.Signals | null) => {
      if (done) return;
      done = true;
      clearTimeout(timer);
      clearTimeout(reapTimer);
      abort?.removeEventListener("abort", onAbort);
      const note = (len: number) => (len > OUTPUT_CAP ? Buffer.from(`\n[kiln: output truncated at ${OUTPUT_CAP} bytes of ${len}]\n`) : Buffer.alloc(0));
      const exit = exitOf(code, signalName(signal), req.args === undefined, oomBefore);
      resolve({
        exit_code: exit.exit_code,
        signal: exit.signal,
        stdout_base64: Buffer.concat([...out, note(outLen)]).toString("base64"),
        stderr_base64: Buffer.concat([...err, note(errLen)]).toString("base64"),
        duration_ms: Math.round((performance.now() - started) * 100) / 100,
        timed_out: timedOut,
        ...(!timedOut && exit.oom_killed ? { oom_killed: true } : {}),
      });
    };
    let reapTimer: NodeJS.Timeout | undefined;
    // Kill the whole tree, stop reading (our pipe ends go), answer as soon as the child is reaped.
    const end = () => {
      signalTree(child);
      child.stdout!.destroy();
      child.stderr!.destroy();
      child.stdin?.destroy();
      if (child.exitCode !== null || child.signalCode !== null) return finish(child.exitCode, child.signalCode);
      reapTimer = setTimeout(() => finish(child.exitCode, child.signalCode ?? "SIGKILL"), REAP_GRACE_MS);
    };
    const onAbort = () => end();
    abort?.addEventListener("abort", onAbort);
    const timer = req.timeout_ms
      ? setTimeout(() => {
          timedOut = true;
          end();
        }, req.timeout_ms)
      : undefined;
    child.on("error", (e: NodeJS.ErrnoException) => {
      clearTimeout(timer);
      if (done) return;
      done = true;
      abort?.removeEventListener("abort", onAbort);
      if (e.code === "ENOENT") reject(new AgentFailure("invalid_request", `Cannot run ${JSON.stringify(req.args === undefined ? "/bin/sh" : req.cmd)}: not found`));
      else if (e.code === "EACCES") reject(new AgentFailure("forbidden", `Permission denied running ${JSON.stringify(req.cmd)}`));
      else reject(new AgentFailure("internal", `spawn failed: ${e.code ?? e.message}`));
    });
    child.on("close", (code, signal) => finish(code, signal));
  });
}
