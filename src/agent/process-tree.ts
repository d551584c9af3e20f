// Ending everything an exec started: its process group, its descendants, and processes that escaped both
// (setsid, double forks) but still hold its stdio — found through /proc, with the exec's own user's eyes.

import { spawnSync } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { readdirSync, readFileSync, readlinkSync } from "node:fs";
import type { UserInfo } from "./protocol.ts";

/**
 * Who each spawned process runs as (what it left behind is looked for with that user's eyes) and when it started:
 * only processes started after it can have inherited its stdio.
 */
const spawned = new WeakMap<ChildProcess, { user: UserInfo; atTick: number }>();
/** Slack for comparing our clock with the kernel's start times (ticks are 10 ms). */
const START_SLACK_TICKS = 5;

/** Records who a spawned process runs as and when it started, for signalTree later. */
export function rememberSpawn(child: ChildProcess, user: UserInfo) {
  spawned.set(child, { user, atTick: ticksNow() });
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
