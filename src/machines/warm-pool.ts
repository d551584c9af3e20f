// A few machines of the base template booted ahead of time with default resources, so a create of that template is
// answered without waiting for a boot: in any vcpus/memory where the driver resizes a running machine (runc: its
// cgroup caps, written at handout), else in exactly the pool's. Pooled machines have no record until one is taken;
// on shutdown they are destroyed, and after a crash the restart removes them as orphans.
// With `demand`, the pool follows its recent creates: it keeps as many machines as creates it could have served in
// the last minute (hits and misses), up to `demand.max`, never fewer than its size, and boots above its size only while
// `room()` allows; a burst's misses so make the next burst of that shape warm, and a minute without creates shrinks it
// back.

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
  stats(): { size: number; ready: number; booting: number; ids: string[] };
  /** How many it keeps booted from now on (a hot template's pool follows its demand); idle ones over it are released. */
  setSize(n: number): void;
  /** Held (its host is draining): the idle machines are released and none are booted until it is let go. */
  hold(held: boolean): void;
  close(): Promise<void>;
}

/** Demand is counted over this last stretch (as the hot pools' rate). */
const DEMAND_WINDOW_MS = 60_000;
/** How often a grown pool checks whether its demand went away. */
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
  /** Grow with demand up to `max` machines (only where `max` is above `size`), booting above `size` only while `room()`. */
  demand?: { max: number; room?: () => boolean };
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
  const inflight = new Set<Promise<unknown>>();
  let closed = false;
  let failures = 0;
  let held = false;
  // When creates this pool could serve came (hit or miss), oldest first; at most `demand.max` are kept.
  const asks: number[] = [];
  const maxDemand = deps.demand && deps.demand.max > deps.size ? deps.demand.max : 0;

  /** How many machines the pool keeps now: its size, or its recent demand while that is higher. */
  function target(): number {
    if (!maxDemand) return size;
    const now = Date.now();
    while (asks.length && now - asks[0]! > DEMAND_WINDOW_MS) asks.shift();
    return Math.max(size, Math.min(maxDemand, asks.length));
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
    ? setInterval(() => {
        if (!closed && ready.length > target()) release(ready.splice(target()));
      }, SHRINK_EVERY_MS)
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
      const make = async () => {
        const live = await driver.create(spec);
        await prepareBooted(live, deps.prepare);
        return live;
      };
      const boot = (deps.boots ? deps.boots.run("pool", make) : make()).then(
        async (live) => {
          booting--;
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
      if (maxDemand) {
        asks.push(Date.now());
        if (asks.length > maxDemand) asks.shift();
      }
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
    stats: () => ({ size: target(), ready: ready.length, booting, ids: ready.map((r) => r.live.id) }),
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
