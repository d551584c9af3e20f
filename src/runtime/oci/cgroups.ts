// What the host's cgroups can enforce: v1, v2 or a hybrid of both (as on these Debian hosts), and which of the
// controllers machines need (cpu, memory, pids, freezer) are really there; and removing what a machine left.

import { existsSync, readFileSync } from "node:fs";
import { readdir, rmdir } from "node:fs/promises";
import { join } from "node:path";

export interface CgroupSupport {
  version: "v1" | "v2" | "hybrid" | "none";
  enforced: string[];
}

const WANTED = ["cpu", "memory", "pids", "freezer"];

export function detectCgroups(root = "/sys/fs/cgroup"): CgroupSupport {
  const unifiedRoot = existsSync(`${root}/cgroup.controllers`);
  if (unifiedRoot) {
    const controllers = readFileSync(`${root}/cgroup.controllers`, "utf8").trim().split(/\s+/);
    // cgroup v2 has no freezer controller: freezing is built into every cgroup (cgroup.freeze).
    return { version: "v2", enforced: WANTED.filter((c) => c === "freezer" || controllers.includes(c)) };
  }
  const v1 = WANTED.filter((c) => existsSync(`${root}/${c}/tasks`) || existsSync(`${root}/${c}/cgroup.procs`));
  if (v1.length === 0) return { version: "none", enforced: [] };
  return { version: existsSync(`${root}/unified/cgroup.controllers`) ? "hybrid" : "v1", enforced: v1 };
}

/**
 * Removes the cgroup at `path` (relative to each hierarchy) wherever it is left. The runtime removes a machine's
 * cgroups when it deletes the container, but not after a failed start or a crash. Only empty ones go (rmdir).
 */
export async function removeCgroups(support: CgroupSupport, path: string, root = "/sys/fs/cgroup"): Promise<void> {
  if (support.version === "none") return;
  // v1 and hybrid hosts have one hierarchy per controller (and a named systemd one): look under each.
  const roots = support.version === "v2" ? [root] : (await readdir(root)).map((c) => join(root, c));
  await Promise.all(roots.map((r) => rmdir(join(r, path)).catch(() => undefined)));
}
