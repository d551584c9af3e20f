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
