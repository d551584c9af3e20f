// Starting processes inside the machine the way every feature needs them: as a named user from the machine's own
// passwd, with a clean environment (machine defaults + request envs, nothing of the agent's own), in their own
// process group so a timeout or signal reaches the whole tree — and, when that is not enough (setsid, daemons),
// every descendant and every process still holding the exec's pipes. Everything started here is the OOM killer's
// first choice, never the agent.

import { spawn, spawnSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync, readlinkSync, writeFileSync } from "node:fs";
import type { ChildProcess } from "node:child_process";
import { constants } from "node:os";
import { lookupUser } from "./users.ts";
import { AgentFailure } from "./errors.ts";
import type { ExecRequest, ExecResult, UserInfo } from "./protocol.ts";

const BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const OUTPUT_CAP = 16 * 1024 * 1024;
/** Processes the agent starts go first under memory pressure; the agent itself keeps the runtime's lower score. */
const CHILD_OOM_SCORE_ADJ = "1000";
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

/**
 * Marks a process the agent started as the OOM killer's first choice (the agent's own score stays low). Written
 * synchronously: a thread-pool write measured slower than the syscall itself.
 */
export function raiseOomScore(pid: number | undefined) {
  if (pid === undefined) return;
  try {
    writeFileSync(`/proc/${pid}/oom_score_adj`, CHILD_OOM_SCORE_ADJ);
  } catch {
    // already gone, or a kernel without the file
  }
}

/** The machine's memory cgroup OOM-kill counter, where the kernel shows it (cgroup v1 or v2); else undefined. */
const OOM_COUNTERS = ["/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events"];
let oomCounterFile: string | null | undefined;
export function oomKills(): number | undefined {
  if (oomCounterFile === undefined) oomCounterFile = OOM_COUNTERS.find((f) => existsSync(f)) ?? null;
  if (!oomCounterFile) return undefined;
  try {
    const m = /^oom_kill (\d+)$/m.exec(readFileSync(oomCounterFile, "utf8"));
    return m ? Number(m[1]) : undefined;
  } catch {
    return undefined;
  }
}

/** True when a process that died of SIGKILL was, as far as the kernel tells, killed by the OOM killer. */
export function wasOomKilled(signal: string | null, before: number | undefined): boolean {
  if (signal !== "SIGKILL" || before === undefined) return false;
  const after = oomKills();
  return after !== undefined && after > before;
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
  spawned.set(child, { user, atTick: ticksNow() });
  return child;
}

/**
 * Who each spawned process runs as (what it left behind is looked for with that user's eyes) and when it started:
 * only processes started after it can have inherited its stdio.
 */
const spawned = new WeakMap<ChildProcess, { user: UserInfo; atTick: number }>();
/** Slack for comparing our wall clock with the kernel's start times (ticks are 10 ms). */
const START_SLACK_TICKS = 5;

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

/**
 * What the child's ends of its stdio look like in /proc/<pid>/fd. libuv makes stdio as socket pairs, whose two
 * ends are two sockets created one after the other, so the child's end is ours + 1 ("socket:[124]" beside our
 * "socket:[123]"); a real pipe has one inode for both ends. Read while our end is still open.
 */
function childEndOf(stream: NodeJS.ReadableStream | NodeJS.WritableStream | null | undefined): string | undefined {
  const fd = (stream as unknown as { _handle?: { fd?: number } } | null)?._handle?.fd;
  if (typeof fd !== "number" || fd < 0) return undefined;
  try {
    const link = readlinkSync(`/proc/self/fd/${fd}`);
    const socket = /^socket:\[(\d+)\]$/.exec(link);
    if (socket) return `socket:[${Number(socket[1]) + 1}]`;
    return link.startsWith("pipe:") ? link : undefined;
  } catch {
    return undefined;
  }
}

function processIds(): number[] {
  return readdirSync("/proc").filter((n) => /^\d+$/.test(n)).map(Number);
}

/** Parent pid and start time (clock ticks since boot) from /proc/<pid>/stat, which anyone may read. */
function statOf(pid: number): { ppid: number; start: number } | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    return { ppid: Number(fields[1]), start: Number(fields[19]) };
  } catch {
    return undefined;
  }
}

/**
 * Now, in the clock ticks since boot (USER_HZ, 100 on Linux) that /proc/<pid>/stat start times use: our own start
 * time plus the monotonic time since (the runtime starts a little after the kernel counts us started, which only
 * makes this earlier, never later).
 */
const SELF_START_TICKS = statOf(process.pid)?.start ?? 0;
function ticksNow(): number {
  return SELF_START_TICKS + performance.now() / 10;
}

/**
 * Every process's open fds (pid → fd number → link target). The agent has no CAP_SYS_PTRACE, so another user's
 * /proc/<pid>/fd is closed to it: those are listed by `ls -l` run as the exec's own user, who may look at its own.
 */
function openFds(user: UserInfo | undefined): Map<number, Map<string, string>> {
  const fds = new Map<number, Map<string, string>>();
  let denied = false;
  for (const pid of processIds()) {
    let names: string[];
    try {
      names = readdirSync(`/proc/${pid}/fd`);
    } catch {
      denied = true;
      continue;
    }
    const links = new Map<string, string>();
    for (const fd of names) {
      try {
        links.set(fd, readlinkSync(`/proc/${pid}/fd/${fd}`));
      } catch (err) {
        // Root may open the directory (DAC override) yet not read the links (ptrace access): ask as the user.
        if ((err as NodeJS.ErrnoException).code === "EACCES") denied = true;
      }
    }
    fds.set(pid, links);
  }
  if (!denied || !user || user.uid === 0) return fds;
  const ls = spawnSync("/bin/sh", ["-c", "exec ls -l /proc/[0-9]*/fd/ 2>/dev/null"], { uid: user.uid, gid: user.gid, encoding: "utf8", timeout: 5000, maxBuffer: 64 * 1024 * 1024 });
  let links: Map<string, string> | undefined;
  for (const line of (ls.stdout ?? "").split("\n")) {
    const header = /^\/proc\/(\d+)\/fd\/?:$/.exec(line);
    const entry = / (\d+) -> (.*)$/.exec(line);
    if (header) fds.set(Number(header[1]), (links = new Map()));
    else if (links && entry) links.set(entry[1], entry[2]);
  }
  return fds;
}

/**
 * Signals everything an exec started: its process group, every descendant of the child (by parent pid), and
 * every process still holding one of its stdio pipes (a `setsid` child escapes the group but keeps stdout).
 * Repeated a few rounds so processes forked meanwhile are caught too.
 */
export function signalTree(child: ChildProcess, signal: NodeJS.Signals = "SIGKILL") {
  const root = child.pid;
  if (root === undefined) return;
  killGroup(child, signal);
  const ends = [childEndOf(child.stdin), childEndOf(child.stdout), childEndOf(child.stderr)].filter((p): p is string => p !== undefined);
  for (let round = 0; round < 3; round++) {
    const stats = new Map(processIds().map((pid) => [pid, statOf(pid)] as const));
    const targets = new Set<number>();
    const tree: Set<number> = new Set([root]);
    // Descendants: grow the set until no process has a parent in it.
    for (let grew = true; grew; ) {
      grew = false;
      for (const [pid, stat] of stats) {
        if (stat && tree.has(stat.ppid) && !tree.has(pid)) {
          tree.add(pid);
          grew = true;
        }
      }
    }
    // The child itself only while it is not reaped (its pid may be reused after).
    const alive = child.exitCode === null && child.signalCode === null;
    for (const pid of [...tree]) if (pid !== root || alive) targets.add(pid);
    const origin = spawned.get(child);
    if (ends.length > 0 && origin) {
      const fds = openFds(origin.user);
      // While the child lives, its own fds 0-2 say exactly which ends are its.
      const wanted = new Set(ends);
      const own = fds.get(root);
      if (alive && own) for (const fd of ["0", "1", "2"]) if (/^(socket|pipe):/.test(own.get(fd) ?? "")) wanted.add(own.get(fd)!);
      // A holder must have started after the child did: the inode guess can never hit an older process.
      const startedAfter = (pid: number) => (stats.get(pid)?.start ?? 0) >= origin.atTick - START_SLACK_TICKS;
      for (const [pid, links] of fds) if (startedAfter(pid) && [...links.values()].some((l) => wanted.has(l))) targets.add(pid);
    }
    targets.delete(process.pid);
    targets.delete(1);
    if (targets.size === 0) return;
    for (const pid of targets) {
      try {
        process.kill(pid, signal);
      } catch {
        // gone already
      }
    }
    if (signal !== "SIGKILL") return; // other signals are delivered once; only a kill is made sure of
  }
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
      const name = signalName(signal);
      resolve({
        exit_code: code,
        signal: name,
        stdout_base64: Buffer.concat([...out, note(outLen)]).toString("base64"),
        stderr_base64: Buffer.concat([...err, note(errLen)]).toString("base64"),
        duration_ms: Math.round((performance.now() - started) * 100) / 100,
        timed_out: timedOut,
        ...(!timedOut && wasOomKilled(name, oomBefore) ? { oom_killed: true } : {}),
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
