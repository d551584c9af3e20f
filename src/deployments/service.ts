// Agent deployments: versions, service instances (one machine and one supervised process each), readiness, rolling
// updates, restarts with request-only envs, status events, signed public URLs, and re-attachment after a restart.

import type { Socket } from "node:net";
import { createKeyedLock } from "../keyed-lock.ts";
import type { KeyObject } from "node:crypto";
import type { Db, DeploymentRow, DeploymentVersionRow, ServiceRow, ServiceUpdate } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import { AgentError } from "../runtime/agent-client.ts";
import type { AgentClient } from "../runtime/agent-client.ts";
import type { ServiceState } from "../agent/protocol.ts";
import type { Logger } from "../log.ts";
import { MACHINE_LIMITS } from "../machines/service.ts";
import type { MachineService } from "../machines/service.ts";
import type { TemplateService } from "../templates/service.ts";
import { Supervisor } from "./supervisor.ts";
import { probe } from "./probe.ts";
import { SERVICE_EVENT_OPERATIONS, assess } from "./lifecycle.ts";
import type { ReadinessDetail, ServiceStatus } from "./lifecycle.ts";
import { announceDeliveries, recordEvent } from "../webhooks/outbox.ts";
import { loadEdgeSecret, signEdgeToken, verifyEdgeToken } from "./edge-tokens.ts";
import { loadEnvSealer } from "./sealed-envs.ts";
import type { EnvSealer } from "./sealed-envs.ts";

export { SERVICE_STATUSES, SERVICE_EVENT_OPERATIONS } from "./lifecycle.ts";

export const DEPLOYMENT_STATUSES = ["active", "deleting", "deleted"] as const;
export const ROLLOUT_STATUSES = ["idle", "rolling", "failed"] as const;

export const READINESS_DEFAULTS = { intervalS: 2, timeoutS: 2 } as const;
/** How long a rollout waits for a new replica to be ready before it gives up. */
const ROLLOUT_READY_TIMEOUT_MS = 5 * 60_000;
/** Machines of services are extended when their expiry is closer than this. */
const MACHINE_EXTEND_MARGIN_MS = 24 * 3600_000;

export interface DeploymentOptions {
  dataDir: string;
  /** Base of public URLs (KILN_PUBLIC_URL); may be set later when the server learns its port. */
  publicUrl: string;
  maxCrashes: number;
  backoffMs: number;
  edgeTokenTtlS: number;
}

export interface ReadinessInput {
  path?: string;
  interval_s?: number;
  timeout_s?: number;
}

export interface CreateDeploymentInput {
  name: string;
  template: string;
  command: string;
  port: number;
  envs?: Record<string, string>;
  replicas?: number;
  public_url?: boolean;
  readiness?: ReadinessInput;
}

export type UpdateDeploymentInput = Partial<CreateDeploymentInput>;

interface Readiness {
  path?: string;
  interval_s: number;
  timeout_s: number;
}

function versionView(v: DeploymentVersionRow) {
  return {
    id: v.id,
    number: v.number,
    template: v.template,
    command: v.command,
    port: v.port,
    env_names: JSON.parse(v.env_names_json) as string[],
    readiness: JSON.parse(v.readiness_json) as Readiness,
    created_at: v.created_at,
  };
}

export function createDeploymentService(deps: { db: Db; machines: MachineService; templates: TemplateService; log: Logger; options: DeploymentOptions; hostId: string }) {
  const { db, machines, log } = deps;
  const opts = { ...deps.options };
  const supervisor = new Supervisor((id, err) => log.error({ err, service_id: id }, "checking a service failed"));
  const locks = createKeyedLock();
  const rollouts = new Map<string, Promise<void>>();
  /** Live probe detail, newer than what is stored (stored only when something meaningful changes). */
  const live = new Map<string, ReadinessDetail>();
  /** Services the edge may route to: id → backing machine and port. */
  const routes = new Map<string, { machineId: string; port: number }>();
  const machineExpiry = new Map<string, number>();
  let secret: KeyObject | undefined;
  let sealer: EnvSealer | undefined;
  /** Tokens already verified, with their expiry: a busy public URL pays for its HMAC once, not per request. */
  const verified = new Map<string, { serviceId: string; expiresAtMs: number }>();
  let closed = false;
  const withLock = locks.run;


  // ── Views ────────────────────────────────────────────────────────────────────────────────────────────────────

  function publicUrlOf(row: ServiceRow, allowed: boolean): string | null {
    if (!allowed || row.status !== "ready" || !row.machine_id || !secret) return null;
    const token = signEdgeToken(secret, row.id, Date.now() + opts.edgeTokenTtlS * 1000);
    return `${opts.publicUrl}/edge/${row.id}/?edge_token=${token}`;
  }

  function detailOf(row: ServiceRow): ReadinessDetail {
    return { ...(JSON.parse(row.readiness_json) as ReadinessDetail), ...live.get(row.id) };
  }

  /** The agent service instance of SPEC.md; public_url is made fresh for each read and never stored. */
  function serviceView(row: ServiceRow, publicAllowed: boolean) {
    return {
      id: row.id,
      deployment_id: row.deployment_id,
      version_id: row.version_id,
      status: row.status as ServiceStatus,
      port: row.port,
      created_at: row.created_at,
      updated_at: row.updated_at,
      machine_id: row.machine_id,
      process_id: row.process_id,
      public_url: publicUrlOf(row, publicAllowed),
      readiness_status: detailOf(row),
      failure_reason: row.failure_reason,
      started_at: row.started_at,
      stopped_at: row.stopped_at,
      idempotency_key: row.idempotency_key,
    };
  }
  type ServiceView = ReturnType<typeof serviceView>;

  async function deploymentView(row: DeploymentRow, withVersions: boolean) {
    const versions = await db.selectFrom("deployment_versions").selectAll().where("deployment_id", "=", row.id).orderBy("number", "desc").execute();
    const current = versions.find((v) => v.id === row.current_version_id)!;
    const cv = versionView(current);
    return {
      id: row.id,
      name: row.name,
      status: row.status as (typeof DEPLOYMENT_STATUSES)[number],
      current_version_id: row.current_version_id,
      version: current.number,
      template: cv.template,
      command: cv.command,
      port: cv.port,
      env_names: cv.env_names,
      readiness: cv.readiness,
      replicas: row.replicas,
      public_url: row.public_url === 1,
      rollout_status: row.rollout_status as (typeof ROLLOUT_STATUSES)[number],
      rollout_error: row.rollout_error,
      created_at: row.created_at,
      updated_at: row.updated_at,
      deleted_at: row.deleted_at,
      ...(withVersions ? { versions: versions.map(versionView) } : {}),
    };
  }

  // ── Store access ─────────────────────────────────────────────────────────────────────────────────────────────

  async function loadDeployment(id: string): Promise<DeploymentRow> {
    const row = await db.selectFrom("deployments").selectAll().where("id", "=", id).executeTakeFirst();
    if (!row) throw new KilnError("not_found", `No deployment ${id}`);
    return row;
  }

  async function loadVersion(id: string): Promise<DeploymentVersionRow> {
    return db.selectFrom("deployment_versions").selectAll().where("id", "=", id).executeTakeFirstOrThrow();
  }

  async function loadService(id: string, deploymentId?: string): Promise<ServiceRow> {
    const row = await db.selectFrom("services").selectAll().where("id", "=", id).executeTakeFirst();
    if (!row || (deploymentId !== undefined && row.deployment_id !== deploymentId)) throw new KilnError("not_found", `No service ${id}${deploymentId ? ` in deployment ${deploymentId}` : ""}`);
    return row;
  }

  /**
   * Writes a service's change; a status change (or an explicit operation) is written as an event — with its webhook
   * deliveries — in the same transaction, its payload the service record without public_url (a URL with a token is
   * never stored).
   */
  async function transition(id: string, set: ServiceUpdate, operation?: string, extra?: (tx: Db, row: ServiceRow) => Promise<void>): Promise<ServiceRow> {
    const now = new Date().toISOString();
    let queued = 0;
    const row = await db.transaction().execute(async (tx) => {
      const before = await tx.selectFrom("services").select("status").where("id", "=", id).executeTakeFirstOrThrow();
      await tx.updateTable("services").set({ ...set, updated_at: now }).where("id", "=", id).execute();
      const after = await tx.selectFrom("services").selectAll().where("id", "=", id).executeTakeFirstOrThrow();
      const op = operation ?? (after.status !== before.status ? SERVICE_EVENT_OPERATIONS[after.status as ServiceStatus] : undefined);
      if (op) {
        const eventId = newId("evt");
        const payload = { id: eventId, operation: op, occurred_at: now, service: { ...serviceView(after, false), readiness_status: JSON.parse(after.readiness_json) } };
        queued = await recordEvent(tx, { id: eventId, operation: op, occurredAt: now, payload, machineId: after.machine_id });
      }
      if (extra) await extra(tx, after);
      return after;
    });
    if (queued > 0) announceDeliveries(db);
    if (row.status === "starting" || row.status === "ready" || row.status === "unhealthy") routes.set(row.id, { machineId: row.machine_id, port: row.port });
    else routes.delete(row.id);
    return row;
  }

  // ── Supervision ──────────────────────────────────────────────────────────────────────────────────────────────

  function agentStartRequest(serviceId: string, version: DeploymentVersionRow) {
    return {
      id: serviceId,
      cmd: version.command,
      user: "user",
      cwd: "/workspace",
      envs: sealer!.open(version.envs_sealed),
      max_crashes: opts.maxCrashes,
      backoff_ms: opts.backoffMs,
      max_backoff_ms: 30_000,
      stable_ms: 10_000,
    };
  }

  function watch(row: ServiceRow, readiness: Readiness, firstMs?: number) {
    supervisor.watch(row.id, readiness.interval_s * 1000, () => check(row.id, readiness), firstMs ?? Math.min(200, readiness.interval_s * 1000));
  }

  /** Marks a service failed (its machine is kept, so its output can still be read). */
  async function fail(id: string, reason: string) {
    supervisor.unwatch(id);
    live.delete(id);
    return transition(id, { status: "failed", failure_reason: reason, stopped_at: new Date().toISOString() });
  }

  /** One supervision step: the process's state from the agent, a readiness probe, and the status that follows. */
  async function check(id: string, readiness: Readiness): Promise<void> {
    await withLock(id, async () => {
      const row = await loadService(id);
      if (row.status !== "starting" && row.status !== "ready" && row.status !== "unhealthy") return supervisor.unwatch(id);
      let agent: AgentClient;
      try {
        agent = (await machines.agentOf(row.machine_id)).agent;
      } catch (err) {
        if (err instanceof KilnError && (err.code === "machine_not_running" || err.code === "not_found")) {
          await fail(id, `the backing machine ${row.machine_id} is not running`);
          return;
        }
        throw err;
      }
      await extendMachine(row.machine_id);
      // null: the agent does not answer (busy or gone); the service counts as not answering either.
      let state: ServiceState | null;
      try {
        state = await agent.serviceState(id);
      } catch (err) {
        if (err instanceof AgentError && err.code === "not_found") {
          // The agent no longer knows the process (it was restarted): start it again from the version.
          state = await agent.startService(agentStartRequest(id, await loadVersion(row.version_id)));
        } else if (err instanceof AgentError && err.code === "unavailable") state = null;
        else throw err;
      }
      const stored = JSON.parse(row.readiness_json) as ReadinessDetail;
      const result =
        state?.status === "running" ? await probe((port) => agent.connectPort(port), { port: row.port, path: readiness.path, timeoutMs: readiness.timeout_s * 1000 }) : null;
      const next = assess({ status: row.status as ServiceStatus, pid: row.process_id, detail: { ...stored, ...live.get(id) }, state, probe: result, path: readiness.path, now: new Date().toISOString() });
      if (next.failure !== null) {
        await transition(id, { readiness_json: JSON.stringify(next.detail), process_id: null });
        await fail(id, next.failure);
        return;
      }
      if (!next.changed) {
        // Probe bookkeeping only: kept in memory and shown on reads, not written every interval.
        const d = next.detail;
        live.set(id, { attempts: d.attempts, last_probe_at: d.last_probe_at, last_ok_at: d.last_ok_at, consecutive_failures: d.consecutive_failures, last_status_code: d.last_status_code });
        return;
      }
      live.delete(id);
      const set: ServiceUpdate = { status: next.status, readiness_json: JSON.stringify(next.detail) };
      if (next.pid !== null && next.pid !== row.process_id) {
        set.process_id = next.pid;
        set.started_at = state?.started_at ?? new Date().toISOString();
      }
      await transition(id, set);
    });
  }

  /** Service machines must not expire: their timeout is pushed out again well before it is due. */
  async function extendMachine(machineId: string) {
    const due = machineExpiry.get(machineId);
    if (due !== undefined && due - Date.now() > MACHINE_EXTEND_MARGIN_MS) return;
    const m = await machines.get(machineId);
    let expires = Date.parse(m.expires_at);
    if (expires - Date.now() <= MACHINE_EXTEND_MARGIN_MS) expires = Date.parse((await machines.update(machineId, { timeout_s: MACHINE_LIMITS.maxTimeoutS })).expires_at);
    machineExpiry.set(machineId, expires);
  }

  // ── Replicas ─────────────────────────────────────────────────────────────────────────────────────────────────

  /** One replica: a machine from the version's template, a service record, and the process started in it. */
  async function createReplica(dep: DeploymentRow, version: DeploymentVersionRow): Promise<ServiceRow> {
    const id = newId("svc");
    const machine = await machines.create({
      template: version.template,
      name: `${dep.name}-${id.slice(-6)}`,
      timeout_s: MACHINE_LIMITS.maxTimeoutS,
      metadata: { "kiln.deployment_id": dep.id, "kiln.service_id": id },
    });
    machineExpiry.set(machine.id, Date.parse(machine.expires_at));
    const now = new Date().toISOString();
    const readiness = JSON.parse(version.readiness_json) as Readiness;
    const detail: ReadinessDetail = { phase: "starting", probe: readiness.path ? "http" : "tcp", ...(readiness.path ? { path: readiness.path } : {}), attempts: 0 };
    await db.transaction().execute(async (tx) => {
      await tx
        .insertInto("services")
        .values({
          id,
          deployment_id: dep.id,
          version_id: version.id,
          status: "starting",
          port: version.port,
          machine_id: machine.id,
          process_id: null,
          readiness_json: JSON.stringify(detail),
          failure_reason: null,
          started_at: null,
          stopped_at: null,
          idempotency_key: null,
          created_at: now,
          updated_at: now,
        })
        .execute();
    });
    // The insert is the starting transition; write its event through the one path that writes service events.
    let row = await transition(id, {}, SERVICE_EVENT_OPERATIONS.starting);
    try {
      const { agent } = await machines.agentOf(machine.id);
      const state = await agent.startService(agentStartRequest(id, version));
      if (state.status === "failed") return fail(id, state.failure_reason ?? "the process could not start");
      row = await transition(id, { process_id: state.pid, started_at: state.started_at ?? now });
    } catch (err) {
      log.error({ err, service_id: id }, "starting a service process failed");
      return fail(id, "the process could not be started in its machine");
    }
    watch(row, readiness);
    return row;
  }

  /** stopping → stopped: the process ends, then its machine is destroyed. A failed service keeps its status. */
  async function stopReplica(id: string): Promise<ServiceRow> {
    return withLock(id, async () => {
      supervisor.unwatch(id);
      live.delete(id);
      let row = await loadService(id);
      if (row.status === "stopped") return row;
      const failed = row.status === "failed";
      if (!failed) row = await transition(id, { status: "stopping" });
      proxy?.drop(id);
      try {
        const { agent } = await machines.agentOf(row.machine_id);
        await agent.stopService(id).catch(() => undefined);
      } catch {
        // the machine is already gone
      }
      await machines.destroy(row.machine_id).catch((err: unknown) => {
        if (!(err instanceof KilnError && err.code === "not_found")) log.error({ err, service_id: id }, "destroying a service's machine failed");
      });
      machineExpiry.delete(row.machine_id);
      if (failed) return row;
      return transition(id, { status: "stopped", process_id: null, stopped_at: new Date().toISOString() });
    });
  }

  /** Waits until a service is ready (true) or failed/stopped/timed out (false), by reading its record. */
  async function waitReady(id: string, deploymentId: string, versionId: string, timeoutMs: number): Promise<boolean> {
    const deadline = Date.now() + timeoutMs;
    while (Date.now() < deadline && !closed) {
      const dep = await loadDeployment(deploymentId);
      if (dep.status !== "active" || dep.current_version_id !== versionId) return false; // deleted or superseded meanwhile
      const row = await loadService(id);
      if (row.status === "ready") return true;
      if (row.status === "failed" || row.status === "stopped" || row.status === "stopping") return false;
      await new Promise((r) => setTimeout(r, 100));
    }
    return false;
  }

  async function activeServices(deploymentId: string): Promise<ServiceRow[]> {
    return db.selectFrom("services").selectAll().where("deployment_id", "=", deploymentId).where("status", "in", ["starting", "ready", "unhealthy"]).orderBy("created_at").execute();
  }

  /**
   * Brings a deployment's services onto its current version, one replica at a time: a new replica first, and an old
   * one stops only once the new one is ready, so some replica answers throughout. Safe to run again after a restart.
   */
  function rollout(deploymentId: string): Promise<void> {
    const prev = rollouts.get(deploymentId) ?? Promise.resolve();
    const next = prev.then(() => rolloutNow(deploymentId)).catch((err: unknown) => log.error({ err, deployment_id: deploymentId }, "rollout failed"));
    rollouts.set(deploymentId, next);
    void next.then(() => {
      if (rollouts.get(deploymentId) === next) rollouts.delete(deploymentId);
    });
    return next;
  }

  async function setRollout(deploymentId: string, status: (typeof ROLLOUT_STATUSES)[number], error: string | null) {
    await db.updateTable("deployments").set({ rollout_status: status, rollout_error: error, updated_at: new Date().toISOString() }).where("id", "=", deploymentId).execute();
  }

  async function rolloutNow(deploymentId: string): Promise<void> {
    try {
      await rolloutSteps(deploymentId);
    } catch (err) {
      log.error({ err, deployment_id: deploymentId }, "rollout failed");
      await setRollout(deploymentId, "failed", err instanceof KilnError ? err.message : "a replica could not be created");
    }
  }

  async function rolloutSteps(deploymentId: string): Promise<void> {
    let dep = await loadDeployment(deploymentId);
    if (dep.status !== "active") return;
    const version = await loadVersion(dep.current_version_id);
    await setRollout(deploymentId, "rolling", null);
    // Failed replicas of any version are replaced; their records stay for inspection.
    const services = await activeServices(deploymentId);
    const current = services.filter((s) => s.version_id === version.id);
    const old = services.filter((s) => s.version_id !== version.id);
    for (const s of current.slice(dep.replicas)) await stopReplica(s.id);
    let have = Math.min(current.length, dep.replicas);
    while (have < dep.replicas && !closed) {
      dep = await loadDeployment(deploymentId);
      if (dep.status !== "active" || dep.current_version_id !== version.id) return; // a newer update or a delete took over
      const fresh = await createReplica(dep, version);
      if (!(await waitReady(fresh.id, deploymentId, version.id, ROLLOUT_READY_TIMEOUT_MS))) {
        const now = await loadDeployment(deploymentId);
        if (now.status !== "active" || now.current_version_id !== version.id) return; // the newer rollout replaces it
        const row = await loadService(fresh.id);
        await setRollout(deploymentId, "failed", `replica ${fresh.id} of version ${version.number} did not become ready (${row.failure_reason ?? row.status})`);
        return;
      }
      have++;
      const retire = old.shift();
      if (retire) await stopReplica(retire.id);
    }
    for (const s of old) await stopReplica(s.id);
    // Failed replicas of earlier versions kept their machines for their logs; once the new version serves, those go.
    const stale = await db.selectFrom("services").select("id").where("deployment_id", "=", deploymentId).where("status", "=", "failed").where("version_id", "!=", version.id).execute();
    for (const s of stale) await stopReplica(s.id);
    if (!closed) await setRollout(deploymentId, "idle", null);
  }

  // ── Public operations ────────────────────────────────────────────────────────────────────────────────────────

  /** Deployment envs are sealed before they reach the store; only their names are kept in the clear. */
  function sealEnvs(envs: Record<string, string>) {
    if (!sealer) throw new KilnError("unavailable", "Deployments are not ready yet");
    return { envs_sealed: sealer.seal(envs), env_names_json: JSON.stringify(Object.keys(envs).sort()) };
  }

  /** The readiness settings of a version: a given `readiness` object replaces the whole of the previous one. */
  function readinessOf(input: ReadinessInput | undefined, base?: Readiness): Readiness {
    if (!input && base) return base;
    const r: Readiness = { interval_s: input?.interval_s ?? READINESS_DEFAULTS.intervalS, timeout_s: input?.timeout_s ?? READINESS_DEFAULTS.timeoutS };
    if (input?.path !== undefined) r.path = input.path;
    return r;
  }

  async function create(input: CreateDeploymentInput) {
    await deps.templates.resolve(input.template); // an unknown template is a 404 before anything is made
    const now = new Date().toISOString();
    const depId = newId("dep");
    const version = {
      id: newId("ver"),
      deployment_id: depId,
      number: 1,
      template: input.template,
      command: input.command,
      port: input.port,
      ...sealEnvs(input.envs ?? {}),
      readiness_json: JSON.stringify(readinessOf(input.readiness)),
      created_at: now,
    };
    const dep: DeploymentRow = {
      id: depId,
      name: input.name,
      current_version_id: version.id,
      replicas: input.replicas ?? 1,
      public_url: input.public_url === false ? 0 : 1,
      status: "active",
      rollout_status: "rolling",
      rollout_error: null,
      created_at: now,
      updated_at: now,
      deleted_at: null,
    };
    await db.transaction().execute(async (tx) => {
      await tx.insertInto("deployments").values(dep).execute();
      await tx.insertInto("deployment_versions").values(version).execute();
    });
    // The first replicas are made before the answer, so the client sees them (starting) and a failing template or
    // machine admission is an error of this request; later ones (updates) roll in the background.
    try {
      for (let i = 0; i < dep.replicas; i++) await createReplica(dep, version);
      await setRollout(depId, "idle", null);
    } catch (err) {
      // The client gets the error and no id: nothing of this deployment may stay behind.
      await remove(depId).catch((e: unknown) => log.error({ err: e, deployment_id: depId }, "removing a deployment whose replicas failed to start failed"));
      throw err;
    }
    return deploymentView(await loadDeployment(depId), true);
  }

  async function update(id: string, input: UpdateDeploymentInput) {
    const updated = await withLock(`dep:${id}`, async () => {
      const dep = await loadDeployment(id);
      if (dep.status !== "active") throw new KilnError("conflict", `Deployment ${id} is ${dep.status}`);
      const cur = await loadVersion(dep.current_version_id);
      if (input.template !== undefined) await deps.templates.resolve(input.template);
      const now = new Date().toISOString();
      const last = await db.selectFrom("deployment_versions").select((eb) => eb.fn.max("number").as("n")).where("deployment_id", "=", id).executeTakeFirstOrThrow();
      const version = {
        id: newId("ver"),
        deployment_id: id,
        number: Number(last.n) + 1,
        template: input.template ?? cur.template,
        command: input.command ?? cur.command,
        port: input.port ?? cur.port,
        ...(input.envs !== undefined ? sealEnvs(input.envs) : { envs_sealed: cur.envs_sealed, env_names_json: cur.env_names_json }),
        readiness_json: JSON.stringify(readinessOf(input.readiness, JSON.parse(cur.readiness_json) as Readiness)),
        created_at: now,
      };
      await db.transaction().execute(async (tx) => {
        await tx.insertInto("deployment_versions").values(version).execute();
        await tx
          .updateTable("deployments")
          .set({
            name: input.name ?? dep.name,
            current_version_id: version.id,
            replicas: input.replicas ?? dep.replicas,
            public_url: input.public_url === undefined ? dep.public_url : input.public_url ? 1 : 0,
            rollout_status: "rolling",
            rollout_error: null,
            updated_at: now,
          })
          .where("id", "=", id)
          .execute();
      });
      return loadDeployment(id);
    });
    void rollout(id);
    return deploymentView(updated, true);
  }

  async function get(id: string) {
    return deploymentView(await loadDeployment(id), true);
  }

  async function list(o: { limit: number; after?: [string, string] }) {
    let q = db.selectFrom("deployments").selectAll().where("status", "!=", "deleted").orderBy("created_at", "desc").orderBy("id", "desc").limit(o.limit + 1);
    const after = o.after;
    if (after) q = q.where((eb) => eb.or([eb("created_at", "<", after[0]), eb.and([eb("created_at", "=", after[0]), eb("id", "<", after[1])])]));
    const rows = await q.execute();
    const page = rows.slice(0, o.limit);
    const last = page.at(-1);
    return { deployments: await Promise.all(page.map((r) => deploymentView(r, false))), last: last ? ([last.created_at, last.id] as [string, string]) : undefined, more: rows.length > o.limit };
  }

  async function remove(id: string) {
    const dep = await withLock(`dep:${id}`, async () => {
      const row = await loadDeployment(id);
      if (row.status === "deleted") return row;
      await db.updateTable("deployments").set({ status: "deleting", updated_at: new Date().toISOString() }).where("id", "=", id).execute();
      return row;
    });
    if (dep.status !== "deleted") {
      await rollouts.get(id);
      const rows = await db.selectFrom("services").selectAll().where("deployment_id", "=", id).where("status", "not in", ["stopped"]).execute();
      for (const s of rows) await stopReplica(s.id);
      const now = new Date().toISOString();
      await db.updateTable("deployments").set({ status: "deleted", rollout_status: "idle", deleted_at: now, updated_at: now }).where("id", "=", id).execute();
    }
    return deploymentView(await loadDeployment(id), true);
  }

  async function listServices(deploymentId: string, o: { status?: ServiceStatus } = {}) {
    const dep = await loadDeployment(deploymentId);
    let q = db.selectFrom("services").selectAll().where("deployment_id", "=", deploymentId).orderBy("created_at", "desc").orderBy("id", "desc");
    if (o.status) q = q.where("status", "=", o.status);
    const rows = await q.execute();
    return rows.map((r) => serviceView(r, dep.public_url === 1));
  }

  async function getService(deploymentId: string, serviceId: string) {
    const dep = await loadDeployment(deploymentId);
    return serviceView(await loadService(serviceId, deploymentId), dep.public_url === 1);
  }

  async function serviceLogs(deploymentId: string, serviceId: string, tailBytes: number) {
    const row = await loadService(serviceId, deploymentId);
    const { agent } = await machines.agentOf(row.machine_id).catch(() => {
      throw new KilnError("conflict", `The machine of service ${serviceId} is gone, and its output with it`);
    });
    const logs = await agent.serviceLogs(serviceId, tailBytes);
    return { service_id: serviceId, process_id: row.process_id, output: Buffer.from(logs.data_base64, "base64").toString("utf8"), total_bytes: logs.total_bytes, truncated: logs.truncated };
  }

  /**
   * Restarts a service's process. `envs` go to the agent in this call only (it keeps them in memory for that process
   * and its crash-restarts); nothing here writes them anywhere. A repeated Idempotency-Key answers the first result.
   */
  async function restart(deploymentId: string, serviceId: string, input: { reason?: string; envs?: Record<string, string> }, idempotencyKey?: string): Promise<ServiceView> {
    const dep = await loadDeployment(deploymentId);
    await loadService(serviceId, deploymentId);
    return withLock(serviceId, async () => {
      if (idempotencyKey !== undefined) {
        const first = await db.selectFrom("service_restarts").select("result_json").where("service_id", "=", serviceId).where("idempotency_key", "=", idempotencyKey).executeTakeFirst();
        if (first) return { ...(JSON.parse(first.result_json) as ServiceView), public_url: null };
      }
      const row = await loadService(serviceId, deploymentId);
      if (row.status === "stopping" || row.status === "stopped") throw new KilnError("conflict", `Service ${serviceId} is ${row.status}`);
      const { agent } = await machines.agentOf(row.machine_id).catch(() => {
        throw new KilnError("conflict", `The machine of service ${serviceId} is not running`);
      });
      const state = await agent.restartService(serviceId, input.envs);
      const now = new Date().toISOString();
      const stored = JSON.parse(row.readiness_json) as ReadinessDetail;
      // The probe's record starts over with the new process; the process counters and restarts carry on.
      const detail: ReadinessDetail = {
        phase: "starting",
        probe: stored.probe,
        ...(stored.path ? { path: stored.path } : {}),
        attempts: 0,
        consecutive_failures: 0,
        last_error: null,
        last_exit: state.last_exit,
        starts: state.starts,
        crashes: state.crashes,
        consecutive_crashes: state.consecutive_crashes,
        restarts: { count: (stored.restarts?.count ?? 0) + 1, last_reason: input.reason ?? null, last_at: now },
      };
      live.delete(serviceId);
      const after = await transition(
        serviceId,
        { status: "starting", process_id: state.pid, started_at: state.started_at ?? now, stopped_at: null, failure_reason: null, idempotency_key: idempotencyKey ?? null, readiness_json: JSON.stringify(detail) },
        SERVICE_EVENT_OPERATIONS.restart,
        async (tx, r) => {
          if (idempotencyKey === undefined) return;
          await tx.insertInto("service_restarts").values({ service_id: serviceId, idempotency_key: idempotencyKey, result_json: JSON.stringify(serviceView(r, false)), created_at: now }).execute();
        },
      );
      const version = await loadVersion(after.version_id);
      watch(after, JSON.parse(version.readiness_json) as Readiness);
      return serviceView(after, dep.public_url === 1);
    });
  }

  // ── The edge ─────────────────────────────────────────────────────────────────────────────────────────────────

  /** Checks an edge token for a service; 401 for a wrong, expired or other service's token. Answers its expiry. */
  function authorizeEdge(serviceId: string, token: string | undefined): number {
    if (!secret) throw new KilnError("unavailable", "The edge is not ready yet");
    if (!token) throw new KilnError("unauthorized", "This public URL needs its edge_token", { detail: { code: "unauthorized", phase: "edge" } });
    const known = verified.get(token);
    if (known && known.serviceId === serviceId && known.expiresAtMs > Date.now()) return known.expiresAtMs;
    const check = verifyEdgeToken(secret, serviceId, token);
    if (!check.ok) {
      const why = check.reason === "expired" ? "The edge_token has expired: read the service again for a fresh public_url" : "The edge_token is not valid for this service";
      throw new KilnError("unauthorized", why, { detail: { code: "unauthorized", phase: "edge", details: { reason: check.reason } } });
    }
    if (verified.size >= 4096) verified.clear(); // a bound, not an LRU: re-verifying is cheap, memory growth is not
    verified.set(token, { serviceId, expiresAtMs: check.expiresAtMs });
    return check.expiresAtMs;
  }

  /** A tunnel to a routable service's port inside its machine. */
  async function openServicePort(serviceId: string): Promise<Socket> {
    const route = routes.get(serviceId);
    if (!route) throw new KilnError("unavailable", `Service ${serviceId} is not running`);
    const { agent } = await machines.agentOf(route.machineId);
    try {
      return await agent.connectPort(route.port);
    } catch (err) {
      throw new KilnError("unavailable", `Service ${serviceId} does not answer on port ${route.port}`, { cause: err, detail: { retryable: true } });
    }
  }

  function isRoutable(serviceId: string): boolean {
    return routes.has(serviceId);
  }

  let proxy: { drop(id: string): void } | undefined;
  /** The edge proxy registers itself so a stopping service's kept-alive tunnels are dropped. */
  function setProxy(p: { drop(id: string): void }) {
    proxy = p;
  }

  // ── Lifecycle ────────────────────────────────────────────────────────────────────────────────────────────────

  /**
   * After a (re)start: the edge secret is loaded, services that were running are re-attached without restarting
   * their processes (the agents kept them), half-stopped ones are finished, and unfinished rollouts resume.
   */
  async function start() {
    secret = await loadEdgeSecret(opts.dataDir);
    sealer = await loadEnvSealer(opts.dataDir);
    // On a store shared by several servers, each supervises the services whose machines it runs.
    const rows = await db
      .selectFrom("services")
      .innerJoin("machines", "machines.id", "services.machine_id")
      .selectAll("services")
      .where("machines.host_id", "=", deps.hostId)
      .where("services.status", "in", ["starting", "ready", "unhealthy", "stopping"])
      .execute();
    let attached = 0;
    for (const row of rows) {
      if (row.status === "stopping") {
        void stopReplica(row.id);
        continue;
      }
      routes.set(row.id, { machineId: row.machine_id, port: row.port });
      const version = await loadVersion(row.version_id);
      watch(row, JSON.parse(version.readiness_json) as Readiness, 0);
      attached++;
    }
    const ours = new Set(rows.map((r) => r.deployment_id));
    const deps_ = (await db.selectFrom("deployments").select(["id", "status", "rollout_status"]).where("status", "!=", "deleted").execute()).filter((d) => ours.has(d.id));
    for (const d of deps_) {
      if (d.status === "deleting") void remove(d.id).catch((err: unknown) => log.error({ err, deployment_id: d.id }, "finishing a delete failed"));
      else if (d.rollout_status === "rolling") void rollout(d.id);
    }
    if (rows.length > 0) log.info({ services: attached }, "services re-attached after start");
  }

  function setPublicUrl(url: string) {
    opts.publicUrl = url.replace(/\/+$/, "");
  }

  async function close() {
    closed = true;
    supervisor.close();
    await Promise.all([...rollouts.values()]);
    await locks.drain();
  }

  return {
    create,
    update,
    get,
    list,
    remove,
    listServices,
    getService,
    serviceLogs,
    restart,
    authorizeEdge,
    openServicePort,
    isRoutable,
    setProxy,
    start,
    setPublicUrl,
    close,
  };
}

export type DeploymentService = ReturnType<typeof createDeploymentService>;
