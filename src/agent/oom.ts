// The agent and the OOM killer: everything the agent starts is the first choice under memory pressure (the agent
// keeps the runtime's low score), and an exit by SIGKILL is told apart as an OOM kill where the kernel counts them.

import { existsSync, readFileSync, writeFileSync } from "node:fs";

/** Processes the agent starts go first under memory pressure; the agent itself keeps the runtime's lower score. */
export const CHILD_OOM_SCORE_ADJ = "1000";

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

/** How a shell reports a command it ran that died of SIGKILL: 128 + 9. */
const SHELL_KILLED = 128 + 9;

/**
 * A process's end as the caller hears it. A program run by `args` that the OOM killer took ends by SIGKILL itself;
 * a shell line's command dies under `sh -c`, which then exits 137 — so a shell line that exits 137 while the
 * machine's OOM-kill counter rose is told the same way: no exit code, SIGKILL, oom_killed.
 */
export function exitOf(code: number | null, signal: string | null, shellLine: boolean, oomBefore: number | undefined): { exit_code: number | null; signal: string | null; oom_killed?: true } {
  if (wasOomKilled(signal, oomBefore)) return { exit_code: code, signal, oom_killed: true };
  if (shellLine && signal === null && code === SHELL_KILLED && wasOomKilled("SIGKILL", oomBefore)) return { exit_code: null, signal: "SIGKILL", oom_killed: true };
  return { exit_code: code, signal };
}
