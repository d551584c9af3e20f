// A few machines of the base template booted ahead of time with default resources, so a create of that template is
// answered without waiting for a boot: in any vcpus/memory where the driver resizes a running machine (runc: its
// cgroup caps, written at handout), else in exactly the pool's. Pooled machines have no record until one is taken;
// on shutdown they are destroyed, and after a crash the restart removes them as orphans.
// With `demand`, the pool follows its recent create rate: it keeps as many machines as the most creates it could have
// served (hits and misses) within one second, the peak held over the last `demand.idleMs` (a minute by default), up to
// `demand.max`, never fewer than its size, and boots above its size only while `room()` allows. A burst so makes the
// next burst of that shape warm, creates one after another do not grow it (the refills keep up with them), and once
// the creates stop for the idle window it shrinks back: idle machines are memory.

import { DEFAULT_DISK_MB } from "../runtime/driver.ts";
import type { LiveMachine, MachineDriver, MachineSpec } from "../runtime/driver.ts";
import { newId } from "../store/ids.ts";
import type { Logger } from "../log.ts";
import type { BootQueue } from "./boot-queue.ts";
import { once } from "node:events";
import { createAgentClient } from "../runtime/agent-client.ts";
import type { AgentClient } from "../runtime/agent-client.ts";

export interface PoolShape {
  artifactId: string;
  layers: string[];
  vcpus: number;
  memoryMb: number;
}

export interface WarmPool {
  /** Sets what pooled machines look like (the base template's current artifact); replaces stale ones. */
  configure(next: PoolShape): void;
  /** A booted machine for this create (resized by the caller where its size differs), or undefined (then the caller boots one). */
  take(want: { artifactId: string; vcpus: number; memoryMb: number; diskMb: number; internet: boolean; network: boolean }): LiveMachine | undefined;
  /**
   * Holds refills back until the returned function is called (every holder's): machines taken meanwhile are not
   * replaced by boots competing for the cores with the handouts still running (a fork's children).
   */
  pause(): () => void;
  /** `size`: how many it keeps now (grown by demand); `max`: the most demand can grow it to. */
  stats(): { size: number; max: number; ready: number; booting: number; ids: string[] };
  /** How many it keeps booted from now on (a hot template's pool follows its demand); idle ones over it are released. */
  setSize(n: number): void;
  /** Held (its host is draining): the idle machines are released and none are booted until it is let go. */
  hold(held: boolean): void;
  close(): Promise<void>;
}

/** The create rate is counted per this stretch: creates within it are what a pool must hold to serve them all warm. */
const RATE_WINDOW_MS = 1_000;
/** A rate's peak is held this long after it was reached (KILN_WARM_POOL_IDLE_S). */
export const DEFAULT_DEMAND_IDLE_MS = 60_000;
/** How often a grown pool checks whether its demand went away (at most). */
const SHRINK_EVERY_MS = 5_000;

/**
 * Opens the booted machine's agent stream socket once and closes it. The agent compiles its WebSocket path (upgrade,
 * frame parsing) on first use: ≈ 15 ms of CPU in the machine that the first stream of its user (an E2B command, a
 * native WebSocket) would otherwise wait for. A pooled machine pays it before anyone waits.
 */
async function warmStreamPath(agent: AgentClient): Promise<void> {
  const ws = agent.openStream();
  try {
    await once(ws, "open");
  } finally {
    ws.terminate();
  }
}

/**
 * A booted machine made ready for handout, through one agent client (closed after): its stream path warmed, then the
 * pool's own step (`prepare`: a hot template's kernel), so the steps share the client's connection to the agent.
 */
async function prepareBooted(live: LiveMachine, prepare?: (live: LiveMachine, agent: AgentClient) => Promise<void>): Promise<void> {
  const agent = createAgentClient(live.agentSocket);
  try {
    await warmStreamPath(agent);
    await prepare?.(live, agent);
  } finally {
    await agent.close().catch(() => undefined);
  }
}

export function createWarmPool(deps: {
  driver: MachineDriver;
  size: number;
  /**
   * Grow with demand up to `max` machines (only where `max` is above `size`), booting above `size` only while `room()`;
   * a peak of demand is held `idleMs` (default a minute).
   */
  demand?: { max: number; idleMs?: number; room?: () => boolean };
  log: Logger;
  /** Refills boot in a slot no create waits for (boot-queue.ts). */
  boots?: BootQueue;
  /**
   * Run on each booted machine before it is ready (a hot template's: its default kernel started), with the agent client
   * the pool's own preparation uses (the pool closes it); a failure destroys the machine.
   */
  prepare?: (live: LiveMachine, agent: AgentClient) => Promise<void>;
  /** Checked before each boot: false while the host has no room for another idle machine (the admission floors). */
  room?: () => boolean;
}): WarmPool {
  const { driver, log } = deps;
  let size = deps.size;
  let shape: PoolShape | undefined;
  const ready: { live: LiveMachine; artifactId: string }[] = [];
  let booting = 0;
  // Of those booting, the ones out of the boot queue (the rest wait for a slot and may yet be skipped).
  let started = 0;
  const inflight = new Set<Promise<unknown>>();
  let closed = false;
  let failures = 0;
  let held = false;
  const maxDemand = deps.demand && deps.demand.max > deps.size ? deps.demand.max : 0;
  const idleMs = deps.demand?.idleMs ?? DEFAULT_DEMAND_IDLE_MS;
  // When creates this pool could serve came (hit or miss) within the last RATE_WINDOW_MS, oldest first; at most
  // `maxDemand` are kept (the target never goes above it).
  const recent: number[] = [];
  // The rates seen within the idle window, each kept only while no later one is as high: the first is the peak.
  const peaks: { at: number; n: number }[] = [];

  function noteAsk(now: number) {
    while (recent.length && now - recent[0]! >= RATE_WINDOW_MS) recent.shift();
    recent.push(now);
    if (recent.length > maxDemand) recent.shift();
    const n = recent.length;
    while (peaks.length && peaks[peaks.length - 1]!.n <= n) peaks.pop();
    peaks.push({ at: now, n });
  }

  /** How many machines the pool keeps now: its size, or its recent demand while that is higher. */
  function target(): number {
    if (!maxDemand) return size;
    const now = Date.now();
    while (peaks.length && now - peaks[0]!.at > idleMs) peaks.shift();
    return Math.max(size, peaks[0]?.n ?? 0);
  }

  /** Idle machines over the target are destroyed (tracked, so close() waits for them as for a boot). */
  function release(extra: { live: LiveMachine }[]) {
    for (const r of extra) {
      const gone = driver.destroy(r.live.id).catch((err: unknown) => log.warn({ err, machine_id: r.live.id }, "releasing a warm machine failed"));
      inflight.add(gone);
      void gone.finally(() => inflight.delete(gone));
    }
  }

  const shrinker = maxDemand
    ? setInterval(
        () => {
          if (!closed && ready.length > target()) release(ready.splice(target()));
        },
        Math.min(SHRINK_EVERY_MS, idleMs),
      )
    : undefined;
  shrinker?.unref();
  let paused = 0;

  function specFor(id: string, s: PoolShape): MachineSpec {
    return { id, layers: s.layers, hostname: id.replaceAll("_", "-"), vcpus: s.vcpus, memoryMb: s.memoryMb, diskMb: DEFAULT_DISK_MB, internet: true, mounts: [] };
  }

  function fill() {
    // Above its size (grown by demand), only while the host has room for another idle machine; not while a holder
    // (a fork handing out its children) has paused refills.
    while (!closed && !held && paused === 0 && shape && ready.length + booting < target() && failures < 3 && (deps.room?.() ?? true) && (ready.length + booting < size || (deps.demand?.room?.() ?? true))) {
      const s = shape;
      const id = newId("mch");
      booting++;
      const spec = specFor(id, s);
      const make = async (): Promise<LiveMachine | undefined> => {
        // Queued behind creates for a while: not booted once it is no longer wanted (closed, held, shrunk, out of date).
        if (closed || held || shape?.artifactId !== s.artifactId || ready.length + started >= target()) return undefined;
        // The host's room is asked again as the boot starts: asked only as boots were queued, a burst's boots would all
        // pass on the memory seen before any of them ran, and grow the pool past the floors once they did.
        if (!(deps.room?.() ?? true) || (ready.length + started >= size && !(deps.demand?.room?.() ?? true))) return undefined;
        started++;
        try {
          const live = await driver.create(spec);
          await prepareBooted(live, deps.prepare);
          return live;
        } finally {
          started--;
        }
      };
      const boot = (deps.boots ? deps.boots.run("pool", make) : make()).then(
        async (live) => {
          booting--;
          if (!live) return;
          failures = 0;
          // Shrunk meanwhile (setSize), held, closed or out of date: not kept.
          if (closed || held || shape?.artifactId !== s.artifactId || ready.length >= target()) return driver.destroy(id);
          ready.push({ live, artifactId: s.artifactId });
        },
        async (err: unknown) => {
          booting--;
          failures++;
          log.warn({ err, machine_id: id }, "booting a warm machine failed");
          await driver.destroy(id).catch(() => undefined);
          if (failures < 3) setTimeout(fill, 1000 * failures).unref();
        },
      );
      inflight.add(boot);
      void boot.finally(() => inflight.delete(boot));
    }
  }

  return {
    /** Sets what pooled machines look like (the base template's current artifact); replaces stale ones. */
    configure(next: PoolShape) {
      if (shape?.artifactId !== next.artifactId) {
        for (const stale of ready.splice(0)) void driver.destroy(stale.live.id).catch(() => undefined);
      }
      shape = next;
      failures = 0;
      fill();
    },
    /** A booted machine for this create (resized by the caller where its size differs), or undefined (then the caller boots one). */
    take(want: { artifactId: string; vcpus: number; memoryMb: number; diskMb: number; internet: boolean; network: boolean }): LiveMachine | undefined {
      if (!shape || want.artifactId !== shape.artifactId) return undefined;
      // Any size where the driver can resize a running machine (the caller does, at handout); else exactly the pool's.
      if (!driver.resize && (want.vcpus !== shape.vcpus || want.memoryMb !== shape.memoryMb)) return undefined;
      // Pooled machines have the default disk and the default egress policy (their slirp4netns is already running).
      if (want.diskMb !== DEFAULT_DISK_MB || !want.internet || want.network) return undefined;
      if (maxDemand) noteAsk(Date.now());
      const i = ready.findIndex((r) => r.artifactId === want.artifactId);
      if (i < 0) {
        if (maxDemand) fill();
        return undefined;
      }
      const [entry] = ready.splice(i, 1);
      fill();
      return entry.live;
    },
    pause() {
      paused++;
      let released = false;
      return () => {
        if (released) return;
        released = true;
        paused--;
        fill();
      };
    },
    stats: () => ({ size: target(), max: Math.max(size, maxDemand), ready: ready.length, booting, ids: ready.map((r) => r.live.id) }),
    setSize(n: number) {
      size = Math.max(0, n);
      release(ready.splice(target()));
      fill();
    },
    hold(next: boolean) {
      if (next === held) return;
      held = next;
      if (held) {
        const idle = ready.splice(0);
        if (idle.length) log.info({ machines: idle.length }, "the host is draining: its idle warm pool is released");
        for (const r of idle) void driver.destroy(r.live.id).catch((err: unknown) => log.warn({ err, machine_id: r.live.id }, "releasing a warm machine failed"));
      } else {
        failures = 0;
        fill();
      }
    },
    async close() {
      closed = true;
      if (shrinker) clearInterval(shrinker);
      await Promise.allSettled([...inflight]);
      await Promise.all(ready.splice(0).map((r) => driver.destroy(r.live.id).catch(() => undefined)));
    },
  };
}
