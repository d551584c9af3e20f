// Starting processes inside the machine the way every feature needs them: as a named user from the machine's own
// passwd, with a clean environment (machine defaults + request envs, nothing of the agent's own), in their own
// process group so a timeout or signal reaches the whole tree.

import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import type { ChildProcess } from "node:child_process";
import { constants } from "node:os";
import { lookupUser } from "./users.ts";
import { AgentFailure } from "./errors.ts";
import type { ExecRequest, ExecResult, UserInfo } from "./protocol.ts";

const BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const OUTPUT_CAP = 16 * 1024 * 1024;

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

/** argv for a request: a shell line through /bin/sh -c, or the program and its args. */
export function argvOf(cmd: string, args: string[] | undefined): [string, string[]] {
  return args === undefined ? ["/bin/sh", ["-c", cmd]] : [cmd, args];
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

export function spawnAs(req: SpawnRequest, opts: { stdin: boolean }): ChildProcess {
  const user = resolveUser(req.user);
  const [file, argv] = argvOf(req.cmd, req.args);
  return spawn(file, argv, {
    cwd: workingDir(req.cwd, user),
    env: processEnv(user, req.envs),
    uid: user.uid,
    gid: user.gid,
    detached: true, // own process group: kill(-pid) reaches everything it started
    stdio: [opts.stdin ? "pipe" : "ignore", "pipe", "pipe"],
  });
}

export function signalName(signal: NodeJS.Signals | null): string | null {
  return signal ?? null;
}

export function killGroup(child: ChildProcess, signal: NodeJS.Signals | number = "SIGKILL") {
  if (child.pid === undefined) return;
  try {
    process.kill(-child.pid, signal);
  } catch {
    try {
      child.kill(signal);
    } catch {
      // already gone
    }
  }
}

export function isSignal(name: string): name is NodeJS.Signals {
  const n = name.startsWith("SIG") ? name : `SIG${name}`;
  return n in constants.signals;
}

/** One-shot exec: runs to completion (or timeout) and returns exit status and both outputs. */
export function execOnce(req: ExecRequest): Promise<ExecResult> {
  const started = performance.now();
  return new Promise((resolve, reject) => {
    let child: ChildProcess;
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
    const timer = req.timeout_ms
      ? setTimeout(() => {
          timedOut = true;
          killGroup(child);
        }, req.timeout_ms)
      : undefined;
    child.on("error", (e: NodeJS.ErrnoException) => {
      clearTimeout(timer);
      if (e.code === "ENOENT") reject(new AgentFailure("invalid_request", `Cannot run ${JSON.stringify(req.args === undefined ? "/bin/sh" : req.cmd)}: not found`));
      else if (e.code === "EACCES") reject(new AgentFailure("forbidden", `Permission denied running ${JSON.stringify(req.cmd)}`));
      else reject(new AgentFailure("internal", `spawn failed: ${e.code ?? e.message}`));
    });
    child.on("close", (code, signal) => {
      clearTimeout(timer);
      const note = (len: number) => (len > OUTPUT_CAP ? Buffer.from(`\n[kiln: output truncated at ${OUTPUT_CAP} bytes of ${len}]\n`) : Buffer.alloc(0));
      resolve({
        exit_code: code,
        signal: signalName(signal),
        stdout_base64: Buffer.concat([...out, note(outLen)]).toString("base64"),
        stderr_base64: Buffer.concat([...err, note(errLen)]).toString("base64"),
        duration_ms: Math.round((performance.now() - started) * 100) / 100,
        timed_out: timedOut,
      });
    });
  });
}
