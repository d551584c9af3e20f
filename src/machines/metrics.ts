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
  /**
   * The samples kept of a machine between `start` and `end` (ms since the epoch, inclusive), oldest first: one every
   * HISTORY.intervalMs while it runs, the last HISTORY.keepMs of them. Kept while it lives (also hibernated), dropped
   * when it is destroyed. Empty when none were taken (a machine younger than one interval, or not on this host).
   */
  history(id: string, range: { start?: number; end?: number }): MachineMetrics[];
  /** Samples every running machine of this host every HISTORY.intervalMs (timer unref'd; stop with stopSampling). */
  startSampling(intervalMs?: number): void;
  stopSampling(): void;
}

/** The per-machine ring of samples behind metrics over a time range (E2B's getMetrics({start, end})). */
export const HISTORY = {
  intervalMs: 5_000,
  keepMs: 3_600_000,
  /** Running machines sampled per tick at most: a bound on the sampler's work, far above one host's machines. */
  maxMachines: 1_000,
} as const;
const RING_SIZE = HISTORY.keepMs / HISTORY.intervalMs; // 720

/**
 * Fixed-size ring of samples: one Float64Array per field, RING_SIZE long (≈ 40 KiB a machine), so a machine's
 * history costs the same from its first sample to its last. NaN stands for a figure the host could not tell.
 */
class Ring {
  private readonly cols = { at: new Float64Array(RING_SIZE), cpuPct: new Float64Array(RING_SIZE), memUsed: new Float64Array(RING_SIZE), memCache: new Float64Array(RING_SIZE), memTotal: new Float64Array(RING_SIZE), diskUsed: new Float64Array(RING_SIZE), diskTotal: new Float64Array(RING_SIZE), cpuCount: new Float64Array(RING_SIZE) };
  private next = 0;
  private size = 0;

  push(m: MachineMetrics) {
    const c = this.cols;
    const i = this.next;
    const num = (x: number | null) => (x === null ? NaN : x);
    c.at[i] = Date.parse(m.timestamp);
    c.cpuPct[i] = num(m.cpu_used_pct);
    c.memUsed[i] = num(m.mem_used_bytes);
    c.memCache[i] = num(m.mem_cache_bytes);
    c.memTotal[i] = m.mem_total_bytes;
    c.diskUsed[i] = num(m.disk_used_bytes);
    c.diskTotal[i] = num(m.disk_total_bytes);
    c.cpuCount[i] = m.cpu_count;
    this.next = (i + 1) % RING_SIZE;
    this.size = Math.min(RING_SIZE, this.size + 1);
  }

  /** When the newest sample was taken (ms since the epoch), or undefined before the first. */
  lastAt(): number | undefined {
    return this.size === 0 ? undefined : this.cols.at[(this.next - 1 + RING_SIZE) % RING_SIZE];
  }

  between(id: string, start: number, end: number): MachineMetrics[] {
    const c = this.cols;
    const out: MachineMetrics[] = [];
    const val = (x: number) => (Number.isNaN(x) ? null : x);
    for (let k = 0; k < this.size; k++) {
      const i = (this.next - this.size + k + RING_SIZE) % RING_SIZE;
      const at = c.at[i];
      if (at < start || at > end) continue;
      out.push({
        machine_id: id,
        timestamp: new Date(at).toISOString(),
        cpu_count: c.cpuCount[i],
        cpu_used_pct: val(c.cpuPct[i]),
        cpu_window_ms: HISTORY.intervalMs,
        cpu_usage_ns: null,
        mem_used_bytes: val(c.memUsed[i]),
        mem_cache_bytes: val(c.memCache[i]),
        mem_total_bytes: c.memTotal[i],
        disk_used_bytes: val(c.diskUsed[i]),
        disk_total_bytes: val(c.diskTotal[i]),
      });
    }
    return out;
  }
}

export function createMachineMetrics(deps: { machines: MachineService; driver: MachineDriver }): MachineMetricsService {
  /** Per machine, the CPU samples a later call measures from: the newest (`cur`) and the one before it. */
  const apiSamples = new Map<string, { cur: CpuSample; prev?: CpuSample }>();
  const ringSamples = new Map<string, { cur: CpuSample; prev?: CpuSample }>();
  const rings = new Map<string, Ring>();
  deps.machines.onStatus((id, status) => {
    if (status !== "running") {
      apiSamples.delete(id);
      ringSamples.delete(id);
    }
    if (status === "destroyed" || status === "failed") rings.delete(id);
  });
  let timer: NodeJS.Timeout | undefined;
  let ticking = false;

  async function sample(id: string): Promise<{ at: number; u: MachineUsage }> {
    const u = await deps.driver.usage(id);
    return { at: performance.now(), u };
  }

  /** The sample to measure from: `cur` when old enough, else the one before it (quick repeated calls wait for none). */
  function baseFor(samples: Map<string, { cur: CpuSample; prev?: CpuSample }>, id: string, at: number, cpuNs: number): CpuSample | undefined {
    const s = samples.get(id);
    const usable = (x: CpuSample | undefined) => x && at - x.at >= MIN_WINDOW_MS && at - x.at <= REUSE_SAMPLE_MS && x.cpuNs <= cpuNs;
    const base = usable(s?.cur) ? s!.cur : usable(s?.prev) ? s!.prev : undefined;
    if (!s) samples.set(id, { cur: { at, cpuNs } });
    else if (at - s.cur.at >= MIN_WINDOW_MS) samples.set(id, { cur: { at, cpuNs }, prev: s.cur });
    return base;
  }

  /** One sample of every running machine of this host, one after another (a machine of another host, or one that stops meanwhile, is skipped). */
  async function tick(intervalMs: number) {
    if (ticking) return; // the last tick is still going: skip this one rather than pile up
    ticking = true;
    try {
      const { machines } = await deps.machines.list({ limit: HISTORY.maxMachines, status: "running" });
      for (const m of machines) {
        if (!timer) return;
        // A slow tick reaches its last machines late; the next tick must not sample them again a moment later.
        const last = rings.get(m.id)?.lastAt();
        if (last !== undefined && Date.now() - last < intervalMs * 0.9) continue;
        const x = await get(m.id, ringSamples).catch(() => undefined);
        if (!x) continue;
        let ring = rings.get(m.id);
        if (!ring) rings.set(m.id, (ring = new Ring()));
        ring.push(x);
      }
    } catch {
      // the store is briefly unavailable: the next tick tries again
    } finally {
      ticking = false;
    }
  }

  /** `samples`: the CPU baselines this caller measures from (the API's, or the sampler's own, so neither moves the other's window). */
  async function get(id: string, samples = apiSamples): Promise<MachineMetrics> {
    const { row } = await deps.machines.agentOf(id, { wake: false }); // not found / not running answer here
    let now = await sample(id);
    let prev = now.u.cpuNs === null ? undefined : baseFor(samples, id, now.at, now.u.cpuNs);
    if (!prev && now.u.cpuNs !== null) {
      prev = { at: now.at, cpuNs: now.u.cpuNs };
      await new Promise((r) => setTimeout(r, FRESH_WINDOW_MS));
      now = await sample(id);
      if (now.u.cpuNs !== null) baseFor(samples, id, now.at, now.u.cpuNs);
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
  }

  return {
    get: (id) => get(id),
    history(id, range) {
      return rings.get(id)?.between(id, range.start ?? 0, range.end ?? Number.MAX_SAFE_INTEGER) ?? [];
    },
    startSampling(intervalMs = HISTORY.intervalMs) {
      if (timer) return;
      timer = setInterval(() => void tick(intervalMs), intervalMs);
      timer.unref();
    },
    stopSampling() {
      if (timer) clearInterval(timer);
      timer = undefined;
    },
  };
}
