// Machines, composed from their parts: records and views (records.ts), create with admission and the warm pool
// (create.ts), lifecycle (lifecycle.ts), the expiry sweeper and health passes (health.ts), adoption after a restart
// (adoption.ts), and the agent clients of running machines (agents.ts).

import { createKeyedLock } from "../keyed-lock.ts";
import type { Db, MachineRow } from "../store/schema.ts";
import { KilnError } from "../errors.ts";
import type { HibernateMode, MachineDriver } from "../runtime/driver.ts";
import type { AgentClient } from "../runtime/agent-client.ts";
import type { Logger } from "../log.ts";
import { newestFirstPage } from "../store/pages.ts";
import type { PageKey } from "../store/pages.ts";
import { MachineRecords, machineView } from "./records.ts";
import type { LifecycleOperation, MachineStatus, MachineView } from "./records.ts";
import { AgentRegistry } from "./agents.ts";
import type { MachineContext } from "./context.ts";
import { createMachineCreator, egressRules } from "./create.ts";
import type { CreateDeps, CreateMachineInput, SnapshotOrigin } from "./create.ts";
import { createMachineLifecycle } from "./lifecycle.ts";
import type { UpdateMachineInput } from "./lifecycle.ts";
import { createMachineHealth } from "./health.ts";
import { createAdoption } from "./adoption.ts";
import type { Teardown } from "./teardown.ts";

export {
  MACHINE_STATUSES,
  LIFECYCLE_OPERATIONS,
  MACHINE_DEFAULTS,
  MACHINE_LIMITS,
  OUT_OF_MEMORY,
  HIBERNATE_MODES,
  ON_TIMEOUT,
  DEFAULT_MAX_HIBERNATION_S,
  machineView,
} from "./records.ts";
export type { MachineStatus, LifecycleOperation, MachineView, OnTimeout } from "./records.ts";
export type { CreateMachineInput, SnapshotOrigin } from "./create.ts";
export type { UpdateMachineInput } from "./lifecycle.ts";

export interface MachineService {
  /** With `from`, the machine is made from a snapshot (room: snapshots resolves and checks it). */
  create(input: CreateMachineInput, from?: SnapshotOrigin): Promise<MachineView>;
  get(id: string): Promise<MachineView>;
  /** Newest first by (created_at, id); `after` is the key of the last row of the previous page. */
  list(opts: { limit: number; after?: PageKey; status?: MachineStatus }): Promise<{ machines: MachineView[]; last?: PageKey; more: boolean }>;
  update(id: string, input: UpdateMachineInput): Promise<MachineView>;
  hibernate(id: string, mode?: HibernateMode): Promise<MachineView>;
  resume(id: string): Promise<MachineView>;
  destroy(id: string, reason?: string): Promise<MachineView>;
  /**
   * The guest agent of a running machine; 409 machine_not_running for any other state. A hibernated machine with
   * auto_resume is woken first, unless `wake` is false.
   */
  agentOf(id: string, opts?: { wake?: boolean }): Promise<{ row: MachineRow; agent: AgentClient }>;
  adopt(): Promise<{ adopted: number; lost: number; removed: number }>;
  sweepExpired(): Promise<void>;
  reapDead(): Promise<number>;
  healLive(): Promise<{ repaired: number; failed: number }>;
  startSweeper(intervalMs?: number): void;
  /** Hears every status change of every machine; answers the function that stops listening. */
  onStatus(listener: (id: string, status: MachineStatus) => void): () => void;
  close(): Promise<void>;
  /** Resolves once destroyed machines' remains are all removed from the host (false when `timeoutMs` passed first). */
  cleanupsSettled(timeoutMs?: number): Promise<boolean>;
  /**
   * Runs `fn` under the machine's lock with its record, for work that must not interleave with its lifecycle (a
   * snapshot); a machine that is not running or hibernated is 409.
   */
  withMachine<T>(id: string, fn: (row: MachineRow) => Promise<T>): Promise<T>;
  /** Records a lifecycle event of a machine that changes no field of it (snapshot, fork). */
  recordLifecycle(id: string, operation: LifecycleOperation, extra: Record<string, unknown>): Promise<void>;
  /**
   * The machine is coming back (restored after a memory snapshot answered): requests for its agent wait until `work`
   * settles instead of finding no agent. The caller holds the machine's lock meanwhile.
   */
  continuing(id: string, work: Promise<void>): void;
  /**
   * Replaces a running or hibernated machine's egress lists (the create's `network`), at once while it runs; an
   * empty or absent list clears it. 400 naming a bad entry; 409 for a machine of another host.
   */
  updateNetwork(id: string, network: CreateMachineInput["network"]): Promise<MachineView>;
}

export function createMachineService(
  deps: {
    db: Db;
    driver: MachineDriver;
    log: Logger;
    hostId: string;
    /** KILN_MAX_HIBERNATION_S: how long a machine with on_timeout "hibernate" may sleep. */
    maxHibernationS?: number;
    teardown: Teardown;
  } & CreateDeps,
): MachineService {
  const { db } = deps;
  const ctx: MachineContext = {
    db,
    driver: deps.driver,
    log: deps.log,
    hostId: deps.hostId,
    locks: createKeyedLock(),
    records: new MachineRecords(db),
    agents: new AgentRegistry(),
    teardown: deps.teardown,
  };
  const { records, agents, locks } = ctx;
  const lifecycle = createMachineLifecycle(ctx, { templates: deps.templates, maxHibernationS: deps.maxHibernationS });
  const health = createMachineHealth(ctx, lifecycle);

  async function get(id: string): Promise<MachineView> {
    return machineView(await records.load(id));
  }

  async function list(opts: { limit: number; after?: PageKey; status?: MachineStatus }) {
    let q = db.selectFrom("machines").selectAll();
    q = opts.status ? q.where("status", "=", opts.status) : q.where("status", "not in", ["destroyed", "failed"]);
    const page = await newestFirstPage(q, opts);
    return { machines: page.rows.map(machineView), last: page.last, more: page.more };
  }

  /** The guest agent of a running machine; 409 machine_not_running for any other state. */
  /** Machines being restored after a memory snapshot: their agent answers once these settle. */
  const comingBack = new Map<string, Promise<void>>();
  function continuing(id: string, work: Promise<void>): void {
    const settled = work.catch(() => undefined);
    comingBack.set(id, settled);
    void settled.then(() => {
      if (comingBack.get(id) === settled) comingBack.delete(id);
    });
  }

  async function agentOf(id: string, opts: { wake?: boolean } = {}): Promise<{ row: MachineRow; agent: AgentClient }> {
    await comingBack.get(id);
    let row = await records.load(id);
    // auto_resume: the request that finds the machine asleep wakes it (under its lock: one wake for many requests).
    if (row.status === "hibernated" && row.auto_resume === 1 && opts.wake !== false) {
      await locks.run(id, async () => lifecycle.resumeLocked(await records.load(id)));
      row = await records.load(id);
    }
    const agent = agents.get(id);
    if (row.status !== "running" || !agent) throw new KilnError("machine_not_running", `Machine ${id} is ${row.status}`);
    return { row, agent };
  }

  async function withMachine<T>(id: string, fn: (row: MachineRow) => Promise<T>): Promise<T> {
    return locks.run(id, async () => {
      const row = await records.load(id);
      if (row.status !== "running" && row.status !== "hibernated") throw new KilnError("machine_not_running", `Machine ${id} is ${row.status}`);
      return fn(row);
    });
  }

  async function updateNetwork(id: string, network: CreateMachineInput["network"]): Promise<MachineView> {
    const rules = egressRules(network);
    const hasRules = Boolean(rules && (rules.allowOut.length || rules.denyOut.length));
    return withMachine(id, async (row) => {
      if (row.host_id !== null && row.host_id !== deps.hostId) throw new KilnError("conflict", `Machine ${id} runs on another host (${row.host_id})`);
      if (!deps.driver.updateNetwork) throw new KilnError("invalid_request", "This host's machine driver cannot change a machine's network");
      await deps.driver.updateNetwork(id, hasRules ? rules : undefined);
      const network_json = hasRules ? JSON.stringify(rules) : null;
      await db.updateTable("machines").set({ network_json, updated_at: new Date().toISOString() }).where("id", "=", id).execute();
      return machineView(await records.load(id));
    });
  }

  async function close() {
    health.stopSweeper();
    await locks.drain();
    for (const id of agents.ids()) await agents.detach(id);
    // Destroyed machines' remains: waited for (bounded); what is left then is finished by the next start.
    await ctx.teardown.close();
  }

  return {
    create: createMachineCreator(ctx, deps),
    get,
    list,
    update: lifecycle.update,
    hibernate: lifecycle.hibernate,
    resume: lifecycle.resume,
    destroy: lifecycle.destroy,
    agentOf,
    adopt: createAdoption(ctx, lifecycle, health),
    sweepExpired: health.sweepExpired,
    reapDead: health.reapDead,
    healLive: health.healLive,
    startSweeper: health.startSweeper,
    onStatus: (listener) => records.onStatus(listener),
    close,
    cleanupsSettled: (timeoutMs) => ctx.teardown.settled(timeoutMs),
    withMachine,
    updateNetwork,
    recordLifecycle: (id, operation, extra) => records.recordLifecycle(id, operation, extra),
    continuing,
  };
}
