// Hot-template pools: a template other than the base (which has its own fixed pool, warm-pool.ts) that is created
// often gets machines of its own booted ahead of time, as many as its recent demand asks for, within per-template and
// host-wide caps and only while the host is above its admission floors. A pool whose template has not been asked for
// during the idle window is released. Machines of a template whose config says `prestartKernel` (the code-interpreter
// template's) are handed out with its default Python kernel already started (E2B snapshots that template with its
// kernel server running), so the first runCode of a create answers without the kernel's start (≈ 3 s with
// numpy/pandas/matplotlib installed).
//
// A pooled kernel started before its machine had a create; at handout (create.ts) it is kept only for the create's
// user and working directory, and the create's envs are set in its os.environ (POST /code/adopt): it sees what a
// kernel started after the create would see. Per-call envs of an execute apply to that execute, as always.

import type { AgentClient } from "../runtime/agent-client.ts";
import type { LiveMachine, MachineDriver } from "../runtime/driver.ts";
import { newId } from "../store/ids.ts";
import type { Logger } from "../log.ts";
import type { BootQueue } from "./boot-queue.ts";
import type { ArtifactConfig } from "../builder/artifact-config.ts";
import { DEFAULT_WORKDIR } from "./paths.ts";
import { MACHINE_DEFAULTS } from "./records.ts";
import { createWarmPool } from "./warm-pool.ts";
import type { WarmPool } from "./warm-pool.ts";

export interface HotPoolSettings {
  /** Most machines one template's pool keeps (0: no hot pools). */
  maxPerTemplate: number;
  /** Most machines all hot pools keep together. */
  maxTotal: number;
  /** Creates of a template within the idle window that make it hot. */
  hotAfter: number;
  /** A template not created for this long loses its pool; demand is counted over this window. */
  idleMs: number;
}

export const HOT_POOL_DEFAULTS: HotPoolSettings = { maxPerTemplate: 2, maxTotal: 4, hotAfter: 2, idleMs: 300_000 };

/** What a hot template's machines are made from and prepared with. */
export interface HotTemplate {
  artifactId: string;
  /** The template's canonical ref (`local/code-interpreter-v1`): how operators read the pool in metrics and readiness. */
  ref: string;
  layers: string[];
  vcpus: number;
  memoryMb: number;
  /**
   * The template's artifact config: its image envs are set in the agent before anything is started in it; with
   * `prestartKernel` (and no start_cmd) the default Python kernel is started, for the image's user and directory.
   */
  config: ArtifactConfig;
}

/** Where a pooled machine's prestarted kernel runs, as whom; none: the template's machines are only booted. */
function kernelOf(t: HotTemplate): { user: string; cwd: string } | undefined {
  const { image, prestartKernel, startCmd } = t.config;
  return prestartKernel && !startCmd ? { user: image.user ?? MACHINE_DEFAULTS.user, cwd: image.workingDir ?? DEFAULT_WORKDIR } : undefined;
}

interface Want {
  artifactId: string;
  vcpus: number;
  memoryMb: number;
  diskMb: number;
  internet: boolean;
  network: boolean;
}

export interface HotPools {
  /** A create of this template (not the base's): counted toward its demand. */
  note(t: HotTemplate): void;
  /** A prepared machine of this template for this create, or undefined. */
  take(want: Want): { live: LiveMachine; kernel?: { user: string; cwd: string } } | undefined;
  stats(): { total: number; templates: HotPoolStats[] };
  /** Held (its host is draining): idle machines released, none booted until let go. */
  hold(held: boolean): void;
  close(): Promise<void>;
}

/** One template's pool (or only its demand, while it has none: size 0, no takes). */
export interface HotPoolStats {
  artifact_id: string;
  template: string;
  /** It has a pool now (else only its demand is counted). */
  pooled: boolean;
  /** How many machines it keeps booted now (its target). */
  size: number;
  ready: number;
  booting: number;
  recent_creates: number;
  /** Creates of the template since its pool was made: handed a pooled machine (hit) or not (miss: none ready). */
  takes: { hit: number; miss: number };
  ids: string[];
}

/** At most this many templates' demand is remembered (the least recently created one without a pool is forgotten). */
const MAX_TRACKED = 64;
/** The most create times kept per template (demand above it reads as the same). */
const MAX_TIMES = 256;
/** Recent rate: creates within this last stretch size the pool (≥ 1 while the template is hot). */
const RATE_WINDOW_MS = 60_000;

/**
 * Starts the template's default Python kernel through the pooled machine's agent (the client the warm pool prepares
 * the machine with, and closes): an empty execute makes it.
 */
async function startKernel(agent: AgentClient, t: HotTemplate): Promise<void> {
  const env = t.config.image.env;
  if (Object.keys(env).length > 0) await agent.setEnvs(env);
  const kernel = kernelOf(t);
  if (!kernel) return;
  const frames = await agent.codeExecute({ code: "", default_context: { id: newId("ctx"), language: "python", cwd: kernel.cwd, user: kernel.user }, timeout_ms: 60_000 });
  let text = "";
  for await (const chunk of frames) text = (text + String(chunk)).slice(-4096);
  if (!text.includes('"type":"end"') || !text.includes('"status":"ok"')) throw new Error(`the pooled kernel did not start: ${text.slice(-300)}`);
}

export function createHotPools(deps: {
  driver: MachineDriver;
  log: Logger;
  settings: HotPoolSettings;
  boots?: BootQueue;
  /** False while the host has no room for another idle machine (admission floors). */
  room?: () => boolean;
}): HotPools {
  const { driver, log, settings } = deps;
  const entries = new Map<string, { t: HotTemplate; times: number[]; pool?: WarmPool; takes: { hit: number; miss: number } }>();
  let held = false;
  let closed = false;

  function evaluate() {
    if (closed) return;
    const now = Date.now();
    for (const e of entries.values()) while (e.times.length && now - e.times[0]! > settings.idleMs) e.times.shift();
    // The hottest templates first, until the host-wide cap is spent.
    let left = settings.maxTotal;
    const byDemand = [...entries.values()].sort((a, b) => b.times.length - a.times.length);
    for (const e of byDemand) {
      const hot = settings.maxPerTemplate > 0 && e.times.length >= settings.hotAfter;
      const recent = e.times.filter((at) => now - at <= RATE_WINDOW_MS).length;
      const target = hot ? Math.min(settings.maxPerTemplate, left, Math.max(1, recent)) : 0;
      left -= target;
      if (target > 0 && !e.pool) {
        e.takes = { hit: 0, miss: 0 };
        e.pool = createWarmPool({ driver, size: 0, log, boots: deps.boots, prepare: (_live, agent) => startKernel(agent, e.t), room: deps.room });
        e.pool.hold(held);
        e.pool.configure({ artifactId: e.t.artifactId, layers: e.t.layers, vcpus: e.t.vcpus, memoryMb: e.t.memoryMb });
        log.info({ artifact_id: e.t.artifactId, size: target }, "a hot template gets a warm pool of its own");
      }
      e.pool?.setSize(target);
      if (target === 0 && e.pool) {
        const s = e.pool.stats();
        if (s.ready + s.booting === 0) {
          void e.pool.close();
          e.pool = undefined;
          log.info({ artifact_id: e.t.artifactId }, "an idle template's warm pool is released");
        }
      }
    }
    for (const [id, e] of entries) if (!e.pool && e.times.length === 0) entries.delete(id);
  }

  const timer = setInterval(evaluate, Math.max(1000, Math.min(15_000, settings.idleMs / 4)));
  timer.unref();

  return {
    note(t: HotTemplate) {
      if (closed || settings.maxPerTemplate <= 0) return;
      let e = entries.get(t.artifactId);
      if (!e) {
        if (entries.size >= MAX_TRACKED) {
          const coldest = [...entries].filter(([, x]) => !x.pool).sort((a, b) => (a[1].times.at(-1) ?? 0) - (b[1].times.at(-1) ?? 0))[0];
          if (!coldest) return;
          entries.delete(coldest[0]);
        }
        e = { t, times: [], takes: { hit: 0, miss: 0 } };
        entries.set(t.artifactId, e);
      }
      e.times.push(Date.now());
      if (e.times.length > MAX_TIMES) e.times.shift();
      evaluate();
    },
    take(want: Want) {
      const e = entries.get(want.artifactId);
      if (!e?.pool) return undefined;
      const live = e.pool.take(want);
      e.takes[live ? "hit" : "miss"]++;
      return live ? { live, kernel: kernelOf(e.t) } : undefined;
    },
    stats() {
      const templates = [...entries.values()].map((e) => {
        const s = e.pool?.stats() ?? { size: 0, ready: 0, booting: 0, ids: [] };
        return { artifact_id: e.t.artifactId, template: e.t.ref, pooled: e.pool !== undefined, size: s.size, ready: s.ready, booting: s.booting, recent_creates: e.times.length, takes: { ...e.takes }, ids: s.ids };
      });
      return { total: templates.reduce((n, t) => n + t.ready + t.booting, 0), templates };
    },
    hold(next: boolean) {
      held = next;
      for (const e of entries.values()) e.pool?.hold(next);
    },
    async close() {
      closed = true;
      clearInterval(timer);
      await Promise.all([...entries.values()].map((e) => e.pool?.close()));
      entries.clear();
    },
  };
}
