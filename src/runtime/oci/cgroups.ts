// What the host's cgroups can enforce: v1, v2 or a hybrid of both (as on these Debian hosts), and which of the
// controllers machines need (cpu, memory, pids, freezer) are really there; removing what a machine left; and the
// host-wide caps on Kiln's parent cgroup (all machines together stay below the host's pid_max and memory).

import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { mkdir, readdir, readFile, rmdir, writeFile } from "node:fs/promises";
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

/** Kiln's parent cgroup: every machine is kiln/<id> below it (and builds below it too), in every hierarchy. */
export const KILN_CGROUP = "kiln";

/** Caps on everything below Kiln's parent cgroup together, so all machines at once cannot exhaust the host. */
export interface HostLimits {
  /** Processes and threads of all machines together (pids.max). */
  pidsMax: number;
  /** Memory of all machines together (memory.limit_in_bytes / memory.max). */
  memoryBytes: number;
}

const GiB = 1024 ** 3;

/**
 * The defaults: three quarters of the host's task limit (the smaller of kernel.pid_max and kernel.threads-max), so
 * the host's own processes always have a quarter; and the host's memory less a reserve of 10 % (at least 1 GiB), in whole MiB.
 */
export function defaultHostLimits(): HostLimits {
  const read = (file: string) => Number(readFileSync(file, "utf8").trim());
  const tasks = Math.min(read("/proc/sys/kernel/pid_max"), read("/proc/sys/kernel/threads-max"));
  const memTotal = Number(/^MemTotal:\s+(\d+) kB/m.exec(readFileSync("/proc/meminfo", "utf8"))![1]) * 1024;
  const MiB = 1024 * 1024;
  // Whole MiB: the kernel keeps the limit in pages.
  const memoryBytes = Math.floor(Math.max(GiB, memTotal - Math.max(GiB, memTotal * 0.1)) / MiB) * MiB;
  return { pidsMax: Math.floor(tasks * 0.75), memoryBytes };
}

/**
 * Writes the caps on Kiln's parent cgroup, making it if missing (the runtime makes machines' cgroups below it).
 * Every Kiln server on a host writes the same defaults, so they agree. Returns what could not be set.
 */
export async function applyHostLimits(support: CgroupSupport, limits: HostLimits, root = "/sys/fs/cgroup"): Promise<string[]> {
  const problems: string[] = [];
  const write = async (dir: string, file: string, value: string) => {
    try {
      await mkdir(dir, { recursive: true });
      await writeFile(join(dir, file), value);
    } catch (err) {
      problems.push(`${join(dir, file)}: ${(err as NodeJS.ErrnoException).code ?? (err as Error).message}`);
    }
  };
  if (support.version === "v2") {
    // The controllers must be on for the children of the root before kiln/ has their files.
    await writeFile(join(root, "cgroup.subtree_control"), "+pids +memory").catch(() => undefined);
    await write(join(root, KILN_CGROUP), "pids.max", String(limits.pidsMax));
    await write(join(root, KILN_CGROUP), "memory.max", String(limits.memoryBytes));
  } else if (support.version !== "none") {
    if (support.enforced.includes("pids")) await write(join(root, "pids", KILN_CGROUP), "pids.max", String(limits.pidsMax));
    if (support.enforced.includes("memory")) await write(join(root, "memory", KILN_CGROUP), "memory.limit_in_bytes", String(limits.memoryBytes));
  }
  return problems;
}

/** A cgroup's freezer, written directly: what a runtime's pause and resume do, without two processes each. */
export interface CgroupFreezer {
  /** Whether the cgroup is frozen (or being frozen) now. */
  frozen(): Promise<boolean>;
  /** Freezes every process of the cgroup; resolves once all are frozen (thawed again when that takes past the bound). */
  freeze(): Promise<void>;
  thaw(): Promise<void>;
}

const FREEZE_WAIT_MS = 5000;

/** The freezer of cgroup `path` (v1 freezer.state or v2 cgroup.freeze); undefined where it has none. */
export function cgroupFreezer(support: CgroupSupport, path: string, root = "/sys/fs/cgroup"): CgroupFreezer | undefined {
  const v2 = support.version === "v2";
  const control = v2 ? join(root, path, "cgroup.freeze") : join(root, "freezer", path, "freezer.state");
  if (!support.enforced.includes("freezer") || !existsSync(control)) return undefined;
  const read = (file: string) => readFile(file, "utf8").then((t) => t.trim());
  const settled = async () => (v2 ? /^frozen 1$/m.test(await read(join(root, path, "cgroup.events"))) : (await read(control)) === "FROZEN");
  return {
    async frozen() {
      return v2 ? (await read(control)) === "1" : (await read(control)) !== "THAWED";
    },
    async freeze() {
      const deadline = performance.now() + FREEZE_WAIT_MS;
      for (;;) {
        // v1 freezes in steps (FREEZING): writing FROZEN again moves tasks that were busy on.
        await writeFile(control, v2 ? "1" : "FROZEN");
        if (await settled()) return;
        if (performance.now() > deadline) {
          await writeFile(control, v2 ? "0" : "THAWED");
          throw new Error(`the processes of ${path} did not freeze within ${FREEZE_WAIT_MS} ms`);
        }
        await new Promise((r) => setTimeout(r, 1));
      }
    },
    async thaw() {
      await writeFile(control, v2 ? "0" : "THAWED");
    },
  };
}

/** How many rounds of reading a cgroup's members and killing the new ones, at most, before it is left to the runtime. */
const KILL_ROUNDS = 20;

/**
 * Kills every process of cgroup `path` at once, without the runtime and without waiting for the kernel. v2:
 * `cgroup.kill`. v1: the freezer is set FREEZING (not waited for: that took 2–35 ms on a loaded host), so a process
 * not yet seen cannot run user code; each member is sent SIGKILL, reading the members again until none is new (a
 * process with SIGKILL pending cannot fork); then thawed, so the signals land. Synchronous file calls on purpose:
 * each is a microsecond syscall that the thread pool would queue behind slower work. Resolves false where the host
 * has no way to (no such cgroup): then the runtime's kill is the only one.
 */
export async function killCgroup(support: CgroupSupport, path: string, root = "/sys/fs/cgroup"): Promise<boolean> {
  if (support.version === "none") return false;
  if (support.version === "v2") {
    const kill = join(root, path, "cgroup.kill");
    if (!existsSync(kill)) return false;
    writeFileSync(kill, "1");
    return true;
  }
  const hierarchy = ["freezer", "pids", "memory", "cpu"].find((c) => support.enforced.includes(c) && existsSync(join(root, c, path, "cgroup.procs")));
  if (!hierarchy) return false;
  const procs = join(root, hierarchy, path, "cgroup.procs");
  const state = hierarchy === "freezer" ? join(root, "freezer", path, "freezer.state") : undefined;
  if (state) writeFileSync(state, "FROZEN");
  try {
    const killed = new Set<number>();
    for (let round = 0; round < KILL_ROUNDS; round++) {
      let fresh = 0;
      const members = (() => {
        try {
          return readFileSync(procs, "utf8");
        } catch {
          return "";
        }
      })();
      for (const pid of members.split("\n").filter(Boolean).map(Number)) {
        if (killed.has(pid)) continue;
        killed.add(pid);
        fresh++;
        try {
          process.kill(pid, "SIGKILL");
        } catch {
          // gone meanwhile
        }
      }
      if (fresh === 0) break;
    }
  } finally {
    if (state) writeFileSync(state, "THAWED");
  }
  return true;
}

/** A running machine's CPU and memory caps, as its spec sets them at boot (spec.ts). */
export interface MachineLimits {
  /** CFS quota per 100 ms period, in µs (vcpus × 100 000). */
  cpuQuotaUs: number;
  memoryBytes: number;
  /** The host accounts swap per cgroup: memory + swap gets the same bound (v1 memsw; v2 no swap at all). */
  limitSwap: boolean;
}

const CPU_PERIOD_US = 100_000;

/**
 * Writes new caps on the running machine's cgroup `path`, what `runc update` would, without its process: the CPU
 * quota, then memory in the order the kernel accepts (v1's memsw must stay ≥ the memory limit, so it is raised
 * first and lowered last). Throws when a file refuses (a memory limit below what the machine already uses).
 */
export async function setMachineLimits(support: CgroupSupport, path: string, limits: MachineLimits, root = "/sys/fs/cgroup"): Promise<void> {
  if (support.version === "none") throw new Error("this host has no cgroups to limit machines with");
  const bytes = String(limits.memoryBytes);
  if (support.version === "v2") {
    const dir = join(root, path);
    await writeFile(join(dir, "cpu.max"), `${limits.cpuQuotaUs} ${CPU_PERIOD_US}`);
    await writeFile(join(dir, "memory.max"), bytes);
    if (limits.limitSwap) await writeFile(join(dir, "memory.swap.max"), "0").catch(() => undefined);
    return;
  }
  await writeFile(join(root, "cpu", path, "cpu.cfs_period_us"), String(CPU_PERIOD_US));
  await writeFile(join(root, "cpu", path, "cpu.cfs_quota_us"), String(limits.cpuQuotaUs));
  const memory = join(root, "memory", path);
  const memsw = join(memory, "memory.memsw.limit_in_bytes");
  const current = Number((await readFile(join(memory, "memory.limit_in_bytes"), "utf8")).trim());
  const swap = limits.limitSwap && existsSync(memsw);
  if (swap && limits.memoryBytes > current) await writeFile(memsw, bytes);
  await writeFile(join(memory, "memory.limit_in_bytes"), bytes);
  if (swap && limits.memoryBytes <= current) await writeFile(memsw, bytes);
}
