// A build machine that runs several steps of a build (docs/builds.md): between two steps every process the last step
// started is killed — frozen first, so none forks away — and only the machine's first processes go on: its init
// (tini, the runtime's first process) and the guest agent (tini's first child). Nothing of step N then writes into
// step N's layer after it is captured, or into step N+1's.

import { execFile } from "node:child_process";
import { lstatSync, readdirSync, readFileSync } from "node:fs";
import { readlink, rm } from "node:fs/promises";
import { join } from "node:path";
import { promisify } from "node:util";
import type { CgroupFreezer } from "./cgroups.ts";

/** How long the killed processes may take to be gone (they are SIGKILLed: the kernel's time, not theirs). */
const GONE_WAIT_MS = 5_000;
/** Bounds on walking a machine's cgroup: a machine cannot make sub-cgroups here, but a bound costs nothing. */
const MAX_DEPTH = 8;
const MAX_MEMBERS = 65_536;

interface ProcStat {
  state: string;
  ppid: number;
  /** Clock ticks after boot: when the process started (with its pid, who it is: pids are reused, start times not). */
  start: number;
}

function procStat(pid: number): ProcStat | undefined {
  try {
    // The command name (in parentheses) may hold anything: fields are read after its last ')'.
    const fields = readFileSync(`/proc/${pid}/stat`, "utf8").replace(/^.*\) /s, "").split(" ");
    return { state: fields[0], ppid: Number(fields[1]), start: Number(fields[19]) };
  } catch {
    return undefined;
  }
}

/**
 * Whether a process runs no more code: gone, or a zombie whose threads are all gone too (a thread group's leader is a
 * zombie as soon as it exits, while its other threads may still run).
 */
function ended(pid: number): boolean {
  const state = procStat(pid)?.state;
  if (state === undefined || state === "X") return true;
  if (state !== "Z") return false;
  try {
    return readdirSync(`/proc/${pid}/task`).every((tid) => Number(tid) === pid || ["Z", "X", undefined].includes(taskState(pid, Number(tid))));
  } catch {
    return true; // reaped meanwhile
  }
}

function taskState(pid: number, tid: number): string | undefined {
  try {
    return readFileSync(`/proc/${pid}/task/${tid}/stat`, "utf8").replace(/^.*\) /s, "").split(" ")[0];
  } catch {
    return undefined;
  }
}

/** Every process of the cgroup dir `dir` and of the cgroups below it. */
export function cgroupMembers(dir: string): number[] {
  const out: number[] = [];
  const walk = (d: string, depth: number) => {
    let text = "";
    try {
      text = readFileSync(join(d, "cgroup.procs"), "utf8");
    } catch {
      return;
    }
    for (const line of text.split("\n")) if (line && out.length < MAX_MEMBERS) out.push(Number(line));
    if (depth >= MAX_DEPTH) return;
    let entries: string[] = [];
    try {
      entries = readdirSync(d, { withFileTypes: true }).filter((e) => e.isDirectory()).map((e) => e.name);
    } catch {
      return;
    }
    for (const name of entries) walk(join(d, name), depth + 1);
  };
  walk(dir, 0);
  return out;
}

/**
 * The machine's first processes among `members` (read while it is frozen): its init and the agent, the init's child
 * that started first. Any other child of the init is an orphan a step left (reparented to it), started later.
 */
export function firstProcesses(init: number, members: number[]): [number, number] {
  if (!members.includes(init)) throw new Error(`the machine's first process ${init} is not in its cgroup`);
  const children = members.map((pid) => ({ pid, s: procStat(pid) })).filter((c) => c.s && c.s.ppid === init && c.pid !== init);
  if (children.length === 0) throw new Error("the machine's agent is gone");
  const first = Math.min(...children.map((c) => c.s!.start));
  const agents = children.filter((c) => c.s!.start === first);
  if (agents.length !== 1) throw new Error("the machine's agent cannot be told from the processes a step left");
  return [init, agents[0].pid];
}

/**
 * Kills every process of the machine (cgroup dir `dir`, frozen by `freezer`) but its init and agent, and resolves once
 * they are gone (a zombie counts as gone: it runs no more code and holds no file).
 */
export async function endStepProcesses(opts: { freezer: CgroupFreezer; dir: string; init: number }): Promise<{ killed: number }> {
  await opts.freezer.freeze();
  let keep: Set<number>;
  let killed = 0;
  try {
    const members = cgroupMembers(opts.dir);
    keep = new Set(firstProcesses(opts.init, members));
    for (const pid of members) {
      if (keep.has(pid)) continue;
      killed++;
      try {
        process.kill(pid, "SIGKILL");
      } catch {
        // gone already
      }
    }
  } finally {
    // Frozen (cgroup v1), the signals land only once thawed.
    await opts.freezer.thaw();
  }
  const deadline = performance.now() + GONE_WAIT_MS;
  for (;;) {
    const left = cgroupMembers(opts.dir).filter((pid) => !keep.has(pid) && !ended(pid));
    if (left.length === 0) return { killed };
    if (performance.now() > deadline) throw new Error(`${left.length} processes of the step were still there ${GONE_WAIT_MS} ms after they were killed`);
    await new Promise((r) => setTimeout(r, 1));
  }
}

/**
 * What a step leaves in memory rather than in its layer — files in /dev, /dev/shm and /dev/mqueue (tmpfs and mqueue
 * mounts, not the overlay), System V shared memory, semaphores and message queues — is removed once its processes are gone:
 * the next step would otherwise read state that no layer below it holds and no cache key names (a step that hits the
 * cache in a fresh machine would not see it). Through the init's root and IPC namespace from the host: the machine's
 * own tools may be missing, and machine root cannot make either path lead elsewhere (/dev and /dev/shm are mount
 * points it cannot move; entries are removed without following links).
 */
export async function clearStepMemory(init: number): Promise<void> {
  await clearDev(init);
  for (const dir of ["dev/shm", "dev/mqueue"]) {
    const path = `/proc/${init}/root/${dir}`;
    let names: string[] = [];
    try {
      if (!lstatSync(path).isDirectory()) continue;
      names = readdirSync(path);
    } catch {
      continue;
    }
    await Promise.all(names.map((n) => rm(join(path, n), { recursive: true, force: true })));
  }
  await promisify(execFile)("nsenter", ["-t", String(init), "--ipc", "--", "ipcrm", "--all"], { timeout: GONE_WAIT_MS });
}

/** The runtime's links in /dev (runc's defaults): kept while they are still the runtime's. */
const DEV_LINKS: Record<string, string> = { fd: "/proc/self/fd", stdin: "/proc/self/fd/0", stdout: "/proc/self/fd/1", stderr: "/proc/self/fd/2", ptmx: "pts/ptmx" };
/** The runtime's devices and mounts in /dev (bind mounts and mount points a machine cannot remove or replace). */
const DEV_MOUNTS = new Set(["null", "zero", "full", "random", "urandom", "tty", "pts", "shm", "mqueue", "console"]);

/** /dev as the runtime made it, less what a step removed: whatever else it put there (its links replaced too) goes. */
async function clearDev(init: number): Promise<void> {
  const dev = `/proc/${init}/root/dev`;
  let names: string[];
  try {
    if (!lstatSync(dev).isDirectory()) return;
    names = readdirSync(dev);
  } catch {
    return;
  }
  await Promise.all(
    names
      .filter((n) => !DEV_MOUNTS.has(n))
      .map(async (n) => {
        const path = join(dev, n);
        const link = DEV_LINKS[n];
        if (link !== undefined && (await readlink(path).catch(() => undefined)) === link) return;
        // A runtime link a step replaced is removed, not made again: made as the host's root it could not be (the tmpfs
        // maps none of the host's ids), and run in the machine's namespaces a tool would be the machine's own binary
        // outside its cgroup and pid namespace. The step broke its own /dev; nothing of it reaches the next step.
        await rm(path, { recursive: true, force: true });
      }),
  );
}
