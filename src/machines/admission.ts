// Admission of new machines: one larger than the host is refused outright (400); while the host is short of
// available memory or the data dir of free disk, creates are turned away for now (503, retryable). Idle machines
// cost little, so pressure is measured (MemAvailable), not inferred from declared sizes, unless an operator caps those.

import { closeSync, openSync, readSync, statfsSync } from "node:fs";
import { cpus, totalmem } from "node:os";
import { sql } from "kysely";
import type { Db } from "../store/schema.ts";
import { KilnError } from "../errors.ts";
import { metricEvents } from "../metrics/events.ts";

const MIB = 1024 * 1024;

/**
 * What one idle machine booted ahead of time is counted as when the pools' bound is derived (measured ≈ 17.5 MiB
 * under runc, docs/BENCHMARKS.md; doubled for the agent's growth and gVisor's larger footprint).
 */
export const IDLE_MACHINE_MB = 32;

export interface AdmissionLimits {
  dataDir: string;
  maxDiskMb: number;
  minFreeDiskMb: number;
  /** Undefined: 10 % of the host's RAM. */
  minFreeMemoryMb?: number;
  memoryOvercommit?: number;
}

/** A record that still holds (or is about to hold) host memory. */
const LIVE_STATUSES = ["creating", "running", "hibernated"];

/** /proc/meminfo, kept open and read again from its start each time (the kernel renders it afresh on every read). */
let meminfoFd: number | undefined;
const meminfoBuf = Buffer.alloc(16 * 1024);

/**
 * The host's MemAvailable. Read synchronously: it is kernel memory, answered in ≈ 20 µs, where an async readFile
 * took four thread-pool round trips (≈ 130 µs idle, milliseconds under load) on every readiness report and create.
 */
function memAvailableMb(): number {
  let text = "";
  try {
    meminfoFd ??= openSync("/proc/meminfo", "r");
    text = meminfoBuf.toString("latin1", 0, readSync(meminfoFd, meminfoBuf, 0, meminfoBuf.length, 0));
  } catch {
    if (meminfoFd !== undefined) closeSync(meminfoFd);
    meminfoFd = undefined;
  }
  const kb = Number(/^MemAvailable:\s+(\d+) kB/m.exec(text)?.[1] ?? NaN);
  return Number.isFinite(kb) ? Math.floor(kb / 1024) : Math.floor(totalmem() / MIB);
}

export interface Admission {
  /** Snapshots take disk (their blocks once the machine rewrites them): refused (503, retryable) under the floor. */
  admitDisk(): Promise<void>;
  /** Refused (503, retryable) when writing this many bytes would take the data dir under its disk floor (a fetched layer). */
  admitBytes(bytes: number): Promise<void>;
  /** Throws 400 for a machine the host can never hold, 503 (retryable) while the host is under pressure. */
  admit(want: { vcpus: number; memoryMb: number; diskMb: number }): Promise<void>;
  /**
   * Room for one more idle machine booted ahead of time (a warm pool's), with `marginMb` to spare above the memory
   * floor and the disk floor met: pools never take a host that creates would find full.
   */
  idleRoom(marginMb: number): boolean;
  /**
   * The most idle machines of `machineMb` each the floors allow booted ahead of time: the memory floor's worth
   * (KILN_MIN_FREE_MEMORY_MB over IDLE_MACHINE_MB, so a full pool costs about what the floor keeps free), and no more
   * than KILN_MEMORY_OVERCOMMIT would admit once they are handed out.
   */
  idleBound(machineMb: number): number;
  /** What GET /v1/ready reports: the host's size, what is in use, and the floors creates are held to. */
  capacity(): Promise<{
    host_cores: number;
    host_memory_mb: number;
    live_machines: number;
    declared_memory_mb: number;
    mem_available_mb: number;
    min_free_memory_mb: number;
    free_disk_mb: number | null;
    min_free_disk_mb: number;
    max_disk_mb: number;
    memory_overcommit: number | null;
    accepting: boolean;
  }>;
}

export function createAdmission(deps: {
  db: Db;
  limits: AdmissionLimits;
  /** Destroyed machines whose remains are still being removed (teardown.ts): they still count as live here. */
  cleaning?: () => { count: number; memoryMb: number };
  /** On a shared store, only this host's machines count. */
  hostId?: string;
}): Admission {
  const { db, limits } = deps;
  const hostMemoryMb = Math.floor(totalmem() / MIB);
  const hostCores = cpus().length;
  const minFreeMemoryMb = limits.minFreeMemoryMb ?? Math.floor(hostMemoryMb / 10);

  /** Free space of the data dir's (local) filesystem: one statfs(2), ≈ 7 µs, so synchronous like memAvailableMb. */
  function freeDiskMb(): number {
    let st;
    try {
      st = statfsSync(limits.dataDir);
    } catch {
      return Number.POSITIVE_INFINITY;
    }
    return Math.floor((Number(st.bavail) * Number(st.bsize)) / MIB);
  }

  // Built and compiled once (it never changes): every readiness report runs it, and building it cost more than running it.
  const liveQuery = db
    .selectFrom("machines")
    .select([sql<number>`count(*)`.as("count"), sql<number>`coalesce(sum(memory_mb), 0)`.as("memory")])
    .where("status", "in", LIVE_STATUSES)
    // On a shared store, only this host's machines hold this host's memory.
    .$if(deps.hostId !== undefined, (q) => q.where((eb) => eb.or([eb("host_id", "=", deps.hostId!), eb("host_id", "is", null)])))
    .compile();

  async function liveMachines(): Promise<{ count: number; declaredMemoryMb: number }> {
    const row = (await db.executeQuery(liveQuery)).rows[0];
    const cleaning = deps.cleaning?.() ?? { count: 0, memoryMb: 0 };
    return { count: Number(row?.count ?? 0) + cleaning.count, declaredMemoryMb: Number(row?.memory ?? 0) + cleaning.memoryMb };
  }

  const busy = (message: string, details: Record<string, unknown>) => new KilnError("unavailable", message, { detail: { code: "unavailable", message, retryable: true, details } });

  async function checkDisk(): Promise<number> {
    const freeDisk = freeDiskMb();
    if (freeDisk < limits.minFreeDiskMb) {
      metricEvents.admissionRefused({ reason: "disk" });
      throw busy(`The host is short of disk (${freeDisk} MiB free in the data dir, the floor is ${limits.minFreeDiskMb} MiB); try again later`, { free_disk_mb: freeDisk, min_free_disk_mb: limits.minFreeDiskMb });
    }
    return freeDisk;
  }

  return {
    /** Snapshots take disk (their blocks once the machine rewrites them): refused (503, retryable) under the floor. */
    async admitDisk(): Promise<void> {
      await checkDisk();
    },

    async admitBytes(bytes: number): Promise<void> {
      const freeDisk = await checkDisk();
      const wantMb = Math.ceil(bytes / MIB);
      if (freeDisk - wantMb < limits.minFreeDiskMb) {
        metricEvents.admissionRefused({ reason: "disk" });
        throw busy(`The host is short of disk for a template layer of ${wantMb} MiB (${freeDisk} MiB free in the data dir, the floor is ${limits.minFreeDiskMb} MiB); try again later`, { free_disk_mb: freeDisk, min_free_disk_mb: limits.minFreeDiskMb, layer_mb: wantMb });
      }
    },

    /** Throws 400 for a machine the host can never hold, 503 (retryable) while the host is under pressure. */
    async admit(want: { vcpus: number; memoryMb: number; diskMb: number }): Promise<void> {
      if (want.vcpus > hostCores) throw new KilnError("invalid_request", `vcpus ${want.vcpus} is more than this host's ${hostCores} cores`);
      if (want.memoryMb > hostMemoryMb) throw new KilnError("invalid_request", `memory_mb ${want.memoryMb} is more than this host's ${hostMemoryMb} MiB of memory`);
      if (want.diskMb > limits.maxDiskMb) throw new KilnError("invalid_request", `disk_mb ${want.diskMb} is more than this server allows (KILN_MAX_DISK_MB=${limits.maxDiskMb})`);
      const available = memAvailableMb();
      if (available < minFreeMemoryMb) {
        metricEvents.admissionRefused({ reason: "memory" });
        throw busy(`The host is short of memory (${available} MiB available, the floor is ${minFreeMemoryMb} MiB); try again later`, { mem_available_mb: available, min_free_memory_mb: minFreeMemoryMb });
      }
      await checkDisk();
      if (limits.memoryOvercommit !== undefined) {
        const cap = Math.floor(hostMemoryMb * limits.memoryOvercommit);
        const { declaredMemoryMb } = await liveMachines();
        if (declaredMemoryMb + want.memoryMb > cap) {
          metricEvents.admissionRefused({ reason: "overcommit" });
          throw busy(`Live machines already declare ${declaredMemoryMb} MiB of memory; the cap is ${cap} MiB (KILN_MEMORY_OVERCOMMIT=${limits.memoryOvercommit})`, { declared_memory_mb: declaredMemoryMb, cap_mb: cap });
        }
      }
    },

    idleRoom(marginMb: number): boolean {
      return memAvailableMb() >= minFreeMemoryMb + marginMb && freeDiskMb() >= limits.minFreeDiskMb;
    },

    idleBound(machineMb: number): number {
      const byFloor = Math.floor(minFreeMemoryMb / IDLE_MACHINE_MB);
      if (limits.memoryOvercommit === undefined) return byFloor;
      return Math.min(byFloor, Math.floor((hostMemoryMb * limits.memoryOvercommit) / Math.max(1, machineMb)));
    },

    /** What GET /v1/ready reports: the host's size, what is in use, and the floors creates are held to. */
    async capacity() {
      const live = await liveMachines();
      const available = memAvailableMb();
      const freeDisk = freeDiskMb();
      return {
        host_cores: hostCores,
        host_memory_mb: hostMemoryMb,
        live_machines: live.count,
        declared_memory_mb: live.declaredMemoryMb,
        mem_available_mb: available,
        min_free_memory_mb: minFreeMemoryMb,
        free_disk_mb: Number.isFinite(freeDisk) ? freeDisk : null,
        min_free_disk_mb: limits.minFreeDiskMb,
        max_disk_mb: limits.maxDiskMb,
        memory_overcommit: limits.memoryOvercommit ?? null,
        accepting: available >= minFreeMemoryMb && freeDisk >= limits.minFreeDiskMb,
      };
    },
  };
}
