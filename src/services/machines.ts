// Machine lifecycle: create from a template, hibernate, resume, update, destroy, expire — each state change
// written with its lifecycle event in one transaction — and adoption of live machines after a restart.

import { EventEmitter } from "node:events";
import { createKeyedLock } from "./keyed-lock.ts";
import type { Db, MachineRow, MachineUpdate } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { metricEvents } from "../metrics/events.ts";
import { KilnError } from "../errors.ts";
import { DEFAULT_DISK_MB } from "../runtime/driver.ts";
import type { EgressRules, LiveMachine, MachineDriver } from "../runtime/driver.ts";
import { parseCidr } from "../runtime/cidr.ts";
import type { Admission } from "./admission.ts";
import { createAgentClient, AgentError } from "../runtime/agent-client.ts";
import type { AgentClient } from "../runtime/agent-client.ts";
import type { TemplateService } from "./templates.ts";
import type { WarmPool } from "./warm-pool.ts";
import type { VolumeMountRequest, VolumeService } from "./volumes.ts";
import type { Logger } from "../log.ts";
import { artifactConfig } from "../builder/artifact-config.ts";
import { runStartCommand } from "../builder/phases/startup.ts";
import { announceDeliveries, recordEvent } from "../webhooks/outbox.ts";
import { checkEnvs, checkMetadata } from "./input-limits.ts";

export const MACHINE_STATUSES = ["creating", "running", "hibernated", "destroyed", "failed"] as const;
export type MachineStatus = (typeof MACHINE_STATUSES)[number];
export const LIFECYCLE_OPERATIONS = ["create", "update", "hibernate", "resume", "destroy"] as const;
export type LifecycleOperation = (typeof LIFECYCLE_OPERATIONS)[number];

export const MACHINE_DEFAULTS = { user: "user", timeoutS: 300, vcpus: 1, memoryMb: 1024, diskMb: DEFAULT_DISK_MB, internet: true } as const;
/** Schema bounds; the host's own size and KILN_MAX_DISK_MB narrow them further at admission. */
export const MACHINE_LIMITS = { maxTimeoutS: 7 * 24 * 3600, maxVcpus: 64, minMemoryMb: 64, maxMemoryMb: 262_144, minDiskMb: 128, maxDiskMb: 16 * 1024 * 1024, maxCidrs: 256 } as const;

/** Said in failure_reason when the driver tells that a machine died of memory. */
export const OUT_OF_MEMORY = "out of memory";
/** Expired machines destroyed at once by the sweeper. */
const EXPIRY_CONCURRENCY = 8;
/** Machines whose host-side parts are checked (and repaired) at once by a health pass. */
const HEAL_CONCURRENCY = 8;
/** Every this many sweeper ticks (seconds): machines that died are reaped, live ones' host-side parts healed. */
const HEALTH_EVERY_TICKS = 2;

export interface CreateMachineInput {
  template?: string;
  name?: string;
  cwd?: string;
  user?: string;
  envs?: Record<string, string>;
  metadata?: Record<string, string>;
  timeout_s?: number;
  vcpus?: number;
  memory_mb?: number;
  disk_mb?: number;
  internet?: boolean;
  /** Volumes mounted at boot (room: volumes). */
  volumes?: VolumeMountRequest[];
  network?: { allow_out?: string[]; deny_out?: string[] };
}

/** Validated CIDR lists in canonical form; 400 naming the first bad entry. */
function egressRules(network: CreateMachineInput["network"]): EgressRules | undefined {
  if (!network) return undefined;
  const canonical = (field: "allow_out" | "deny_out") =>
    (network[field] ?? []).map((text, i) => {
      const parsed = parseCidr(text);
      if ("error" in parsed) throw new KilnError("invalid_request", `network.${field}[${i}]: ${parsed.error}`);
      return parsed.cidr;
    });
  return { allowOut: canonical("allow_out"), denyOut: canonical("deny_out") };
}

export interface UpdateMachineInput {
  name?: string;
  timeout_s?: number;
  metadata?: Record<string, string>;
}

/** The machine record as the API shows it (envs are never part of it). */
export function machineView(row: MachineRow) {
  return {
    id: row.id,
    template_id: row.template_id,
    artifact_id: row.artifact_id,
    name: row.name,
    status: row.status as MachineStatus,
    cwd: row.cwd,
    user: row.user,
    vcpus: row.vcpus,
    memory_mb: row.memory_mb,
    disk_mb: row.disk_mb,
    internet: row.internet === 1,
    network: networkView(row.network_json),
    timeout_s: row.timeout_s,
    created_at: row.created_at,
    updated_at: row.updated_at,
    expires_at: row.expires_at,
    destroyed_at: row.destroyed_at,
    failure_reason: row.failure_reason,
    metadata: JSON.parse(row.metadata_json) as Record<string, string>,
  };
}
export type MachineView = ReturnType<typeof machineView>;

function networkView(json: string | null): { allow_out: string[]; deny_out: string[] } {
  const rules = json ? (JSON.parse(json) as EgressRules) : undefined;
  return { allow_out: rules?.allowOut ?? [], deny_out: rules?.denyOut ?? [] };
}

export function createMachineService(deps: { db: Db; driver: MachineDriver; templates: TemplateService; log: Logger; baseTemplateRef: string; pool?: WarmPool; hostId: string; volumes?: VolumeService; admission?: Admission }) {
  const { db, driver, templates, log, hostId } = deps;
  const agents = new Map<string, AgentClient>();
  const locks = createKeyedLock();
  let sweeper: NodeJS.Timeout | undefined;
  /** Machines an expiry sweep is destroying right now. */
  const expiring = new Set<string>();
  // Tells streams (WebSockets) attached to a machine that its execution changed under them.
  const statusChanges = new EventEmitter<{ status: [id: string, status: MachineStatus] }>();
  statusChanges.setMaxListeners(0);

  /** Serialises lifecycle operations on one machine so hibernate/destroy/expiry never interleave. */
  const withLock = locks.run;

  async function load(id: string): Promise<MachineRow> {
    const row = await db.selectFrom("machines").selectAll().where("id", "=", id).executeTakeFirst();
    if (!row) throw new KilnError("not_found", `No machine ${id}`);
    return row;
  }

  /** Applies a state change and records its lifecycle event in the same transaction. */
  async function transition(id: string, set: MachineUpdate, operation: LifecycleOperation | null): Promise<MachineRow> {
    const now = new Date().toISOString();
    let queued = 0;
    return db.transaction().execute(async (tx) => {
      await tx.updateTable("machines").set({ ...set, updated_at: now }).where("id", "=", id).execute();
      const row = await tx.selectFrom("machines").selectAll().where("id", "=", id).executeTakeFirstOrThrow();
      if (operation) {
        const eventId = newId("evt");
        const payload = { id: eventId, operation, occurred_at: now, machine: machineView(row) };
        queued = await recordEvent(tx, { id: eventId, operation, occurredAt: now, payload, machineId: id });
      }
      return row;
    }).then((row) => {
      if (set.status) statusChanges.emit("status", id, set.status as MachineStatus);
      if (queued > 0) announceDeliveries(db);
      return row;
    });
  }

  function onStatus(listener: (id: string, status: MachineStatus) => void): () => void {
    statusChanges.on("status", listener);
    return () => statusChanges.off("status", listener);
  }

  function attach(live: LiveMachine): AgentClient {
    agents.get(live.id)?.close();
    const client = createAgentClient(live.agentSocket);
    agents.set(live.id, client);
    return client;
  }

  /** Drops a machine's agent client without waiting: execs in flight answer 409 and the agent ends their commands. */
  async function detach(id: string) {
    const client = agents.get(id);
    agents.delete(id);
    await client?.destroy().catch(() => undefined);
  }

  async function create(input: CreateMachineInput): Promise<MachineView> {
    checkEnvs(input.envs);
    checkMetadata(input.metadata);
    const resolved = await templates.resolve(input.template ?? deps.baseTemplateRef);
    // A built template's image config gives the defaults: its envs, working directory and user.
    const image = artifactConfig(resolved.artifact);
    const now = new Date();
    const timeoutS = input.timeout_s ?? MACHINE_DEFAULTS.timeoutS;
    const vcpus = input.vcpus ?? MACHINE_DEFAULTS.vcpus;
    const memoryMb = input.memory_mb ?? MACHINE_DEFAULTS.memoryMb;
    const diskMb = input.disk_mb ?? MACHINE_DEFAULTS.diskMb;
    const network = egressRules(input.network);
    const hasRules = Boolean(network && (network.allowOut.length || network.denyOut.length));
    await deps.admission?.admit({ vcpus, memoryMb, diskMb });
    // A machine already booted with exactly this shape answers at once; its id is the one it was booted with.
    // One with volumes boots fresh: warm machines have no mounts (room: volumes).
    // gVisor: continue the build machine saved once start_cmd was ready, where this machine can take it (same
    // network setting, same guest runtime, image still on disk); otherwise start_cmd starts here and create waits for
    // its readiness.
    const saved = image.checkpoint;
    const restore = saved && saved.internet === (input.internet !== false) && driver.canRestore?.(saved) ? saved : undefined;
    const warm = restore || input.volumes?.length ? undefined : deps.pool?.take({ artifactId: resolved.artifact.id, vcpus, memoryMb, diskMb, internet: input.internet !== false, network: hasRules });
    if (!restore && !input.volumes?.length) metricEvents.warmPoolTake({ hit: warm !== undefined });
    const row = {
      id: warm?.id ?? newId("mch"),
      template_id: resolved.template.id,
      artifact_id: resolved.artifact.id,
      name: input.name ?? null,
      status: "creating",
      cwd: input.cwd ?? image.image.workingDir ?? null,
      user: input.user ?? image.image.user ?? MACHINE_DEFAULTS.user,
      metadata_json: JSON.stringify(input.metadata ?? {}),
      vcpus,
      memory_mb: memoryMb,
      disk_mb: diskMb,
      internet: input.internet === false ? 0 : 1,
      network_json: hasRules ? JSON.stringify(network) : null,
      timeout_s: timeoutS,
      expires_at: new Date(now.getTime() + timeoutS * 1000).toISOString(),
      created_at: now.toISOString(),
      updated_at: now.toISOString(),
      destroyed_at: null,
      failure_reason: null,
      host_id: hostId,
    };
    // Volumes (room: volumes): checked and recorded before the row, so a racing volume delete already sees this machine.
    const mounts = input.volumes?.length && deps.volumes ? await deps.volumes.attach(row.id, input.volumes) : [];
    await db.insertInto("machines").values(row).execute();
    return withLock(row.id, async () => {
      try {
        // A machine that waited in the pool may have lost a host-side part meanwhile (its network helper).
        if (warm) {
          const health = await driver.heal(warm.id);
          if (!health.ok) throw new Error(health.reason);
        }
        const live =
          warm ??
          (await driver.create({
          id: row.id,
          layers: resolved.layers,
          hostname: row.id.replaceAll("_", "-"),
          vcpus: row.vcpus,
          memoryMb: row.memory_mb,
          diskMb,
          internet: row.internet === 1,
          network: hasRules ? network : undefined,
          mounts,
          restore,
        }));
        const agent = attach(live);
        // The user must exist in the machine's own /etc/passwd; envs live in the agent, never in a record.
        await agent.user(row.user).catch((err: unknown) => {
          throw err instanceof AgentError && err.code === "not_found" ? new KilnError("invalid_request", `No user ${JSON.stringify(row.user)} in template ${resolved.template.canonical_ref}`) : err;
        });
        // The start command sees the template's envs only; create-time envs apply to what runs after it.
        if (Object.keys(image.image.env).length > 0) await agent.setEnvs(image.image.env);
        if (!restore) await runStartCommand(agent, image, row.user);
        if (input.envs && Object.keys(input.envs).length > 0) await agent.setEnvs({ ...image.image.env, ...input.envs });
        // The machine's cwd is where its commands start: make sure it exists, owned by the machine's user.
        if (row.cwd) await agent.mkdir(row.cwd, { user: row.user });
        return machineView(await transition(row.id, { status: "running" }, "create"));
      } catch (err) {
        await detach(row.id);
        await driver.destroy(row.id).catch((e: unknown) => log.error({ err: e, machine_id: row.id }, "cleanup after a failed create failed"));
        const reason = err instanceof KilnError ? err.message : "the machine failed to start";
        await transition(row.id, { status: "failed", failure_reason: reason, destroyed_at: new Date().toISOString() }, null);
        if (err instanceof KilnError) throw err;
        log.error({ err, machine_id: row.id }, "machine create failed");
        throw new KilnError("internal", "The machine failed to start", { cause: err });
      }
    });
  }

  async function get(id: string): Promise<MachineView> {
    return machineView(await load(id));
  }

  /** Newest first by (created_at, id); `after` is the key of the last row of the previous page. */
  async function list(opts: { limit: number; after?: [string, string]; status?: MachineStatus }): Promise<{ machines: MachineView[]; last?: [string, string]; more: boolean }> {
    let q = db.selectFrom("machines").selectAll().orderBy("created_at", "desc").orderBy("id", "desc").limit(opts.limit + 1);
    const after = opts.after;
    if (after) q = q.where((eb) => eb.or([eb("created_at", "<", after[0]), eb.and([eb("created_at", "=", after[0]), eb("id", "<", after[1])])]));
    q = opts.status ? q.where("status", "=", opts.status) : q.where("status", "not in", ["destroyed", "failed"]);
    const rows = await q.execute();
    const more = rows.length > opts.limit;
    const page = rows.slice(0, opts.limit);
    const lastRow = page.at(-1);
    return { machines: page.map(machineView), last: lastRow ? [lastRow.created_at, lastRow.id] : undefined, more };
  }

  async function update(id: string, input: UpdateMachineInput): Promise<MachineView> {
    checkMetadata(input.metadata);
    return withLock(id, async () => {
      const row = await load(id);
      if (row.status === "destroyed" || row.status === "failed") throw new KilnError("conflict", `Machine ${id} is ${row.status}`);
      const set: MachineUpdate = {};
      if (input.name !== undefined) set.name = input.name;
      if (input.metadata !== undefined) set.metadata_json = JSON.stringify(input.metadata);
      if (input.timeout_s !== undefined) {
        set.timeout_s = input.timeout_s;
        set.expires_at = new Date(Date.now() + input.timeout_s * 1000).toISOString();
      }
      return machineView(await transition(id, set, "update"));
    });
  }

  async function hibernate(id: string): Promise<MachineView> {
    return withLock(id, async () => {
      const row = await load(id);
      if (row.status === "hibernated") return machineView(row);
      if (row.status !== "running") throw new KilnError("machine_not_running", `Machine ${id} is ${row.status}`);
      // Execs in flight end here (409 to their callers, their commands killed by the agent), not at resume.
      const socketPath = agents.get(id)?.socketPath;
      await detach(id);
      try {
        await driver.hibernate(id);
      } catch (err) {
        if (socketPath) agents.set(id, createAgentClient(socketPath));
        throw err;
      }
      return machineView(await transition(id, { status: "hibernated" }, "hibernate"));
    });
  }

  async function resume(id: string): Promise<MachineView> {
    return withLock(id, async () => {
      const row = await load(id);
      if (row.status === "running") return machineView(row);
      if (row.status !== "hibernated") throw new KilnError("conflict", `Machine ${id} is ${row.status} and cannot be resumed`);
      const live = await driver.resume(id);
      const agent = attach(live);
      // A resumed machine is a new execution: PTY sessions of the old one are not reconnectable (SPEC.md).
      await agent.resetSessions();
      return machineView(await transition(id, { status: "running" }, "resume"));
    });
  }

  async function destroy(id: string, reason?: string): Promise<MachineView> {
    return withLock(id, async () => machineView(await destroyLocked(await load(id), reason)));
  }

  /** Destroys a machine whose lock the caller holds; a destroyed or failed one is left as it is. */
  async function destroyLocked(row: MachineRow, reason?: string): Promise<MachineRow> {
    if (row.status === "destroyed" || row.status === "failed") return row;
    await detach(row.id);
    await driver.destroy(row.id);
    const set: MachineUpdate = { status: "destroyed", destroyed_at: new Date().toISOString() };
    if (reason) set.failure_reason = reason;
    return transition(row.id, set, "destroy");
  }

  /** Why a machine that is gone died, asked of the driver before its destroy removes the evidence. */
  async function deathReason(id: string, fallback = "the machine stopped unexpectedly"): Promise<string> {
    const cause = await driver.deathCause(id).catch(() => undefined);
    return cause === "out_of_memory" ? OUT_OF_MEMORY : fallback;
  }

  /**
   * Machines whose processes are gone without Kiln stopping them (killed from outside, the host's OOM killer, a
   * crash of the runtime) are destroyed — so their mount, cgroups and network helper go too — and say why.
   * Rows are read before the runtime's list, so a machine that became running in between was already live.
   */
  async function reapDead(): Promise<number> {
    const rows = await db.selectFrom("machines").select("id").where("host_id", "=", hostId).where("status", "in", ["running", "hibernated"]).execute();
    if (rows.length === 0) return 0;
    const live = new Set((await driver.listLive()).map((m) => m.id));
    let reaped = 0;
    for (const { id } of rows) {
      if (live.has(id)) continue;
      await withLock(id, async () => {
        const row = await load(id);
        // Checked again under the lock: a concurrent destroy may have got there first.
        if (row.status !== "running" && row.status !== "hibernated") return;
        if ((await driver.listLive()).some((m) => m.id === id)) return;
        const reason = await deathReason(id);
        log.warn({ machine_id: id, reason }, "machine stopped unexpectedly; destroying it");
        await destroyLocked(row, reason);
        reaped++;
      }).catch((err: unknown) => log.error({ err, machine_id: id }, "destroying a machine that stopped failed"));
    }
    return reaped;
  }

  /** One machine's host-side parts, under its lock: repaired by the driver, or the machine destroyed with why not. */
  async function healOne(id: string): Promise<"ok" | "repaired" | "failed" | "skipped"> {
    return withLock(id, async () => {
      const row = await load(id);
      if (row.status !== "running" && row.status !== "hibernated") return "skipped";
      const health = await driver.heal(id);
      if (health.ok) {
        if (health.repaired.length === 0) return "ok";
        log.warn({ machine_id: id, repaired: health.repaired }, "a machine's host-side parts were repaired");
        return "repaired";
      }
      log.warn({ machine_id: id, reason: health.reason }, "a machine's host-side parts cannot be repaired; destroying it");
      await destroyLocked(row, health.reason);
      return "failed";
    });
  }

  /**
   * The host-side parts of every running or hibernated machine (its network helper, the host files it writes):
   * what died is started again, logs past their cap are trimmed, and a machine that cannot be repaired is destroyed
   * with the reason. Runs every few seconds and at start (after adoption).
   */
  async function healLive(): Promise<{ repaired: number; failed: number }> {
    const rows = await db.selectFrom("machines").select("id").where("host_id", "=", hostId).where("status", "in", ["running", "hibernated"]).execute();
    const queue = rows.map((r) => r.id);
    const counts = { repaired: 0, failed: 0 };
    const next = async (): Promise<void> => {
      const id = queue.shift();
      if (id === undefined) return;
      const result = await healOne(id).catch((err: unknown) => {
        log.error({ err, machine_id: id }, "checking a machine's host-side parts failed");
        return "skipped" as const;
      });
      if (result === "repaired") counts.repaired++;
      if (result === "failed") counts.failed++;
      return next();
    };
    await Promise.all(Array.from({ length: Math.min(HEAL_CONCURRENCY, queue.length) }, next));
    return counts;
  }

  /** The guest agent of a running machine; 409 machine_not_running for any other state. */
  async function agentOf(id: string): Promise<{ row: MachineRow; agent: AgentClient }> {
    const row = await load(id);
    const agent = agents.get(id);
    if (row.status !== "running" || !agent) throw new KilnError("machine_not_running", `Machine ${id} is ${row.status}`);
    return { row, agent };
  }

  /**
   * Destroys machines whose timeout has passed. Runs every second; cheap because of the status index. Up to
   * EXPIRY_CONCURRENCY destroys run at once across sweeps, so one slow destroy never delays another's expiry.
   */
  async function sweepExpired(): Promise<void> {
    const now = new Date().toISOString();
    const due = await db.selectFrom("machines").select("id").where("host_id", "=", hostId).where("status", "in", ["running", "hibernated"]).where("expires_at", "<=", now).execute();
    const queue = due.map((r) => r.id).filter((id) => !expiring.has(id));
    const expireNext = async (): Promise<void> => {
      const id = queue.shift();
      if (id === undefined) return;
      expiring.add(id);
      await destroy(id, "timeout")
        .catch((err: unknown) => log.error({ err, machine_id: id }, "destroying an expired machine failed"))
        .finally(() => expiring.delete(id));
      return expireNext();
    };
    const slots = Math.max(0, EXPIRY_CONCURRENCY - expiring.size);
    await Promise.all(Array.from({ length: Math.min(slots, queue.length) }, expireNext));
  }

  /**
   * After a restart: machines still alive are adopted, the ones that are gone are marked destroyed, and runtime
   * containers with no record (or a destroyed one) are removed, so nothing leaks.
   */
  async function adopt(): Promise<{ adopted: number; lost: number; removed: number }> {
    const live = new Map((await driver.listLive()).map((m) => [m.id, m]));
    // Records from before hosts were named belong to the first server that starts on this store again.
    await db.updateTable("machines").set({ host_id: hostId }).where("host_id", "is", null).execute();
    const rows = await db.selectFrom("machines").selectAll().where("host_id", "=", hostId).where("status", "in", ["creating", "running", "hibernated"]).execute();
    let adopted = 0;
    let lost = 0;
    for (const row of rows) {
      const m = live.get(row.id);
      live.delete(row.id);
      if (m && row.status !== "creating") {
        attach(m);
        const status = m.state === "paused" ? "hibernated" : "running";
        if (status !== row.status) await transition(row.id, { status }, status === "running" ? "resume" : "hibernate");
        adopted++;
        continue;
      }
      const reason = row.status === "creating" ? "the server stopped while the machine was being created" : await deathReason(row.id, "the machine was gone after a restart");
      await driver.destroy(row.id).catch(() => undefined);
      await transition(row.id, { status: row.status === "creating" ? "failed" : "destroyed", destroyed_at: new Date().toISOString(), failure_reason: reason }, row.status === "creating" ? null : "destroy");
      lost++;
    }
    for (const orphan of live.keys()) await driver.destroy(orphan).catch((err: unknown) => log.error({ err, machine_id: orphan }, "removing an orphan machine failed"));
    // What died while no server watched (a network helper) is repaired now, before anything is served.
    await healLive();
    return { adopted, lost, removed: live.size };
  }

  /**
   * Expiry every second; every HEALTH_EVERY_TICKS seconds a health pass: machines that stopped on their own are
   * reaped, and live ones' host-side parts checked and repaired.
   */
  function startSweeper(intervalMs = 1000) {
    let tick = 0;
    let checking = false;
    sweeper = setInterval(() => {
      void sweepExpired().catch((err: unknown) => log.error({ err }, "expiry sweep failed"));
      if (++tick % HEALTH_EVERY_TICKS !== 0 || checking) return;
      checking = true;
      void reapDead()
        .catch((err: unknown) => log.error({ err }, "looking for stopped machines failed"))
        .then(() => healLive())
        .catch((err: unknown) => log.error({ err }, "checking machines' host-side parts failed"))
        .finally(() => (checking = false));
    }, intervalMs);
    sweeper.unref();
  }

  async function close() {
    if (sweeper) clearInterval(sweeper);
    await locks.drain();
    for (const id of [...agents.keys()]) await detach(id);
  }

  return { create, get, list, update, hibernate, resume, destroy, agentOf, adopt, sweepExpired, reapDead, healLive, startSweeper, onStatus, close };
}

export type MachineService = ReturnType<typeof createMachineService>;
