// A running machine's resource use (GET /v1/machines/{id}/metrics): the driver's counters turned into figures a
// user reads — CPU as a share of the machine's vCPUs over a recent interval, memory against its limit, disk.

import type { MachineDriver, MachineUsage } from "../runtime/driver.ts";
import type { MachineService } from "./service.ts";

/** A previous CPU sample younger than this (and at least MIN_WINDOW_MS old) is the start of the interval. */
const REUSE_SAMPLE_MS = 60_000;
const MIN_WINDOW_MS = 100;
/** Without a usable previous sample, CPU use is measured over this window (the call waits for it). */
const FRESH_WINDOW_MS = 200;

export interface MachineMetrics {
  machine_id: string;
  timestamp: string;
  cpu_count: number;
  /** Share of the machine's vCPUs used over the last `cpu_window_ms`, 0–100; null when the host cannot tell. */
  cpu_used_pct: number | null;
  cpu_window_ms: number;
  /** CPU time used since the machine (re)started. */
  cpu_usage_ns: number | null;
  /** Memory in use, page cache excluded; the page cache; the machine's memory limit. */
  mem_used_bytes: number | null;
  mem_cache_bytes: number | null;
  mem_total_bytes: number;
  disk_used_bytes: number | null;
  disk_total_bytes: number | null;
}

interface CpuSample {
  at: number;
  cpuNs: number;
}

export interface MachineMetricsService {
  get(id: string): Promise<MachineMetrics>;
}

export function createMachineMetrics(deps: { machines: MachineService; driver: MachineDriver }): MachineMetricsService {
  /** Per machine, the CPU samples a later call measures from: the newest (`cur`) and the one before it. */
  const samples = new Map<string, { cur: CpuSample; prev?: CpuSample }>();
  deps.machines.onStatus((id, status) => {
    if (status !== "running") samples.delete(id);
  });

  async function sample(id: string): Promise<{ at: number; u: MachineUsage }> {
    const u = await deps.driver.usage(id);
    return { at: performance.now(), u };
  }

  /** The sample to measure from: `cur` when old enough, else the one before it (quick repeated calls wait for none). */
  function baseFor(id: string, at: number, cpuNs: number): CpuSample | undefined {
    const s = samples.get(id);
    const usable = (x: CpuSample | undefined) => x && at - x.at >= MIN_WINDOW_MS && at - x.at <= REUSE_SAMPLE_MS && x.cpuNs <= cpuNs;
    const base = usable(s?.cur) ? s!.cur : usable(s?.prev) ? s!.prev : undefined;
    if (!s) samples.set(id, { cur: { at, cpuNs } });
    else if (at - s.cur.at >= MIN_WINDOW_MS) samples.set(id, { cur: { at, cpuNs }, prev: s.cur });
    return base;
  }

  return {
    async get(id: string): Promise<MachineMetrics> {
      const { row } = await deps.machines.agentOf(id, { wake: false }); // not found / not running answer here
      let now = await sample(id);
      let prev = now.u.cpuNs === null ? undefined : baseFor(id, now.at, now.u.cpuNs);
      if (!prev && now.u.cpuNs !== null) {
        prev = { at: now.at, cpuNs: now.u.cpuNs };
        await new Promise((r) => setTimeout(r, FRESH_WINDOW_MS));
        now = await sample(id);
        if (now.u.cpuNs !== null) baseFor(id, now.at, now.u.cpuNs);
      }
      const windowMs = prev ? now.at - prev.at : 0;
      const cpuPct = prev && now.u.cpuNs !== null && windowMs > 0 ? Math.min(100, ((now.u.cpuNs - prev.cpuNs) / 1e6 / windowMs / row.vcpus) * 100) : null;
      const { memoryBytes, memoryCacheBytes } = now.u;
      return {
        machine_id: id,
        timestamp: new Date().toISOString(),
        cpu_count: row.vcpus,
        cpu_used_pct: cpuPct === null ? null : Math.round(cpuPct * 100) / 100,
        cpu_window_ms: Math.round(windowMs),
        cpu_usage_ns: now.u.cpuNs,
        mem_used_bytes: memoryBytes === null ? null : Math.max(0, memoryBytes - (memoryCacheBytes ?? 0)),
        mem_cache_bytes: memoryCacheBytes,
        mem_total_bytes: row.memory_mb * 1024 * 1024,
        disk_used_bytes: now.u.diskUsedBytes,
        disk_total_bytes: now.u.diskTotalBytes,
      };
    },
  };
}
