// Replicas and their supervision: starting a replica (a machine, a service record, its process), stopping one, and
// the periodic check of each running service (the agent's process state, a readiness probe, the status that follows).

import type { KeyedLock } from "../keyed-lock.ts";
import type { Db, DeploymentRow, DeploymentVersionRow, ServiceRow, ServiceUpdate } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import { AgentError } from "../runtime/agent-client.ts";
import type { AgentClient } from "../runtime/agent-client.ts";
import type { ServiceState } from "../agent/protocol.ts";
import type { Logger } from "../log.ts";
import { MACHINE_LIMITS } from "../machines/service.ts";
import type { MachineService } from "../machines/service.ts";
import { Supervisor } from "./supervisor.ts";
import { probe } from "./probe.ts";
import { SERVICE_EVENT_OPERATIONS, assess } from "./lifecycle.ts";
import type { ReadinessDetail, ServiceStatus } from "./lifecycle.ts";
import type { DeploymentRecords } from "./records.ts";
import type { DeploymentEdge } from "./edge.ts";
import { readinessOfVersion } from "./views.ts";
import type { Readiness } from "./views.ts";
import type { ReplicaHosts } from "./spread.ts";

/** Machines of services are extended when their expiry is closer than this. */
const MACHINE_EXTEND_MARGIN_MS = 24 * 3600_000;

/** Live probe detail, newer than what is stored (stored only when something meaningful changes). */
export class ProbeDetails {
  readonly #live = new Map<string, ReadinessDetail>();

  /** The detail to show for a service: the stored one with newer probe bookkeeping over it. */
  of(row: ServiceRow): ReadinessDetail {
    return { ...(JSON.parse(row.readiness_json) as ReadinessDetail), ...this.#live.get(row.id) };
  }

  get(id: string): ReadinessDetail | undefined {
    return this.#live.get(id);
  }

  set(id: string, d: ReadinessDetail): void {
    this.#live.set(id, d);
  }

  forget(id: string): void {
    this.#live.delete(id);
  }
}

/** When each service machine expires, as last read: a check extends a machine only when its expiry comes close. */
class MachineLeases {
  readonly #expiry = new Map<string, number>();

  get(machineId: string): number | undefined {
    return this.#expiry.get(machineId);
  }

  set(machineId: string, expiresAtMs: number): void {
    this.#expiry.set(machineId, expiresAtMs);
  }

  forget(machineId: string): void {
    this.#expiry.delete(machineId);
  }
}

export interface SupervisionDeps {
  db: Db;
  machines: MachineService;
  log: Logger;
  records: DeploymentRecords;
  edge: DeploymentEdge;
  locks: KeyedLock;
  opts: { maxCrashes: number; backoffMs: number };
  /** Opens a version's sealed envs (the sealer is loaded at start). */
  openEnvs: (sealed: string) => Record<string, string>;
  hostId: string;
  /** Where replicas go on a store shared by hosts (this host alone otherwise). */
  spread: ReplicaHosts;
}

export class ServiceSupervision {
  readonly probes = new ProbeDetails();
  readonly #leases = new MachineLeases();
  readonly #supervisor: Supervisor;
  readonly #d: SupervisionDeps;
  /**
   * Envs of replicas another host asked this one to make, as that host opened them: a version's envs are sealed
   * under the key of the server that wrote them (its data dir), which this host does not hold. Kept in memory only.
   */
  readonly #peerEnvs = new Map<string, Record<string, string>>();

  constructor(deps: SupervisionDeps) {
    this.#d = deps;
    this.#supervisor = new Supervisor((id, err) => deps.log.error({ err, service_id: id }, "checking a service failed"));
  }

  #agentStartRequest(serviceId: string, version: DeploymentVersionRow) {
    return {
      id: serviceId,
      cmd: version.command,
      user: "user",
      cwd: "/workspace",
      envs: this.#envsOf(serviceId, version),
      max_crashes: this.#d.opts.maxCrashes,
      backoff_ms: this.#d.opts.backoffMs,
      max_backoff_ms: 30_000,
      stable_ms: 10_000,
    };
  }

  #envsOf(serviceId: string, version: DeploymentVersionRow): Record<string, string> {
    const given = this.#peerEnvs.get(serviceId);
    if (given) return given;
    try {
      return this.#d.openEnvs(version.envs_sealed);
    } catch {
      throw new KilnError("conflict", `The envs of version ${version.number} were sealed by another host's server (each seals with its own data dir's key); restart the service through the deployment's own server or PATCH the deployment`);
    }
  }

  /** Checks a service every readiness interval, the first time after `firstMs`. */
  watch(row: ServiceRow, readiness: Readiness, firstMs?: number): void {
    this.#supervisor.watch(row.id, readiness.interval_s * 1000, () => this.#check(row.id, readiness), firstMs ?? Math.min(200, readiness.interval_s * 1000));
  }

  /** Marks a service failed (its machine is kept, so its output can still be read). */
  async fail(id: string, reason: string): Promise<ServiceRow> {
    this.#supervisor.unwatch(id);
    this.probes.forget(id);
    return this.#d.records.transition(id, { status: "failed", failure_reason: reason, stopped_at: new Date().toISOString() });
  }

  /** One supervision step: the process's state from the agent, a readiness probe, and the status that follows. */
  async #check(id: string, readiness: Readiness): Promise<void> {
    const { records, machines } = this.#d;
    await this.#d.locks.run(id, async () => {
      const row = await records.loadService(id);
      if (row.status !== "starting" && row.status !== "ready" && row.status !== "unhealthy") return this.#supervisor.unwatch(id);
      let agent: AgentClient;
      try {
        agent = (await machines.agentOf(row.machine_id)).agent;
      } catch (err) {
        if (err instanceof KilnError && (err.code === "machine_not_running" || err.code === "not_found")) {
          await this.fail(id, `the backing machine ${row.machine_id} is not running`);
          return;
        }
        throw err;
      }
      await this.#extendMachine(row.machine_id);
      // null: the agent does not answer (busy or gone); the service counts as not answering either.
      let state: ServiceState | null;
      try {
        state = await agent.serviceState(id);
      } catch (err) {
        if (err instanceof AgentError && err.code === "not_found") {
          // The agent no longer knows the process (it was restarted): start it again from the version.
          state = await agent.startService(this.#agentStartRequest(id, await records.loadVersion(row.version_id)));
        } else if (err instanceof AgentError && err.code === "unavailable") state = null;
        else throw err;
      }
      const stored = JSON.parse(row.readiness_json) as ReadinessDetail;
      const result =
        state?.status === "running" ? await probe((port, timeoutMs) => agent.connectPort(port, timeoutMs), { port: row.port, path: readiness.path, timeoutMs: readiness.timeout_s * 1000 }) : null;
      const next = assess({ status: row.status as ServiceStatus, pid: row.process_id, detail: { ...stored, ...this.probes.get(id) }, state, probe: result, path: readiness.path, now: new Date().toISOString() });
      if (next.failure !== null) {
        await records.transition(id, { readiness_json: JSON.stringify(next.detail), process_id: null });
        await this.fail(id, next.failure);
        return;
      }
      if (!next.changed) {
        // Probe bookkeeping only: kept in memory and shown on reads, not written every interval.
        const d = next.detail;
        this.probes.set(id, { attempts: d.attempts, last_probe_at: d.last_probe_at, last_ok_at: d.last_ok_at, consecutive_failures: d.consecutive_failures, last_status_code: d.last_status_code });
        return;
      }
      this.probes.forget(id);
      const set: ServiceUpdate = { status: next.status, readiness_json: JSON.stringify(next.detail) };
      if (next.pid !== null && next.pid !== row.process_id) {
        set.process_id = next.pid;
        set.started_at = state?.started_at ?? new Date().toISOString();
      }
      await records.transition(id, set);
    });
  }

  /** Service machines must not expire: their timeout is pushed out again well before it is due. */
  async #extendMachine(machineId: string): Promise<void> {
    const { machines } = this.#d;
    const due = this.#leases.get(machineId);
    if (due !== undefined && due - Date.now() > MACHINE_EXTEND_MARGIN_MS) return;
    const m = await machines.get(machineId);
    let expires = Date.parse(m.expires_at);
    if (expires - Date.now() <= MACHINE_EXTEND_MARGIN_MS) expires = Date.parse((await machines.update(machineId, { timeout_s: MACHINE_LIMITS.maxTimeoutS })).expires_at);
    this.#leases.set(machineId, expires);
  }

  /**
   * One replica, on the host that runs the fewest replicas of this deployment (then by placement's order): made here
   * or asked of that host. A host that refuses for now (503) or cannot be reached is skipped for the next.
   * `detail`: what the replica's readiness_status records of why it was made (a replacement names the one it replaces).
   */
  async createReplica(dep: DeploymentRow, version: DeploymentVersionRow, detail?: ReadinessDetail): Promise<ServiceRow> {
    const { spread, log } = this.#d;
    let last: unknown;
    for (const host of await spread.order(dep.id)) {
      try {
        if (host.url === "" || host.id === this.#d.hostId) return await this.createHere(dep, version, undefined, detail);
        return await spread.createOn(host, { deployment_id: dep.id, version_id: version.id, envs: this.#d.openEnvs(version.envs_sealed), ...(detail ? { detail } : {}) });
      } catch (err) {
        if (!(err instanceof KilnError && err.code === "unavailable")) throw err;
        log.info({ err: err.message, host_id: host.id, deployment_id: dep.id }, "a host refused a replica for now; trying the next");
        last = err;
      }
    }
    throw last ?? new KilnError("unavailable", "No host can take a replica now; try again later", { detail: { retryable: true } });
  }

  /** One replica on this host: a machine from the version's template, a service record, and the process started in it. */
  async createHere(dep: DeploymentRow, version: DeploymentVersionRow, envs?: Record<string, string>, extra?: ReadinessDetail): Promise<ServiceRow> {
    const { db, machines, records, log } = this.#d;
    const id = newId("svc");
    const machine = await machines.create({
      template: version.template,
      name: `${dep.name}-${id.slice(-6)}`,
      timeout_s: MACHINE_LIMITS.maxTimeoutS,
      metadata: { "kiln.deployment_id": dep.id, "kiln.service_id": id },
    });
    if (envs) this.#peerEnvs.set(id, envs);
    this.#leases.set(machine.id, Date.parse(machine.expires_at));
    const now = new Date().toISOString();
    const readiness = readinessOfVersion(version);
    const detail: ReadinessDetail = { ...extra, phase: "starting", probe: readiness.path ? "http" : "tcp", ...(readiness.path ? { path: readiness.path } : {}), attempts: 0 };
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
    let row = await records.transition(id, {}, SERVICE_EVENT_OPERATIONS.starting);
    try {
      const { agent } = await machines.agentOf(machine.id);
      const state = await agent.startService(this.#agentStartRequest(id, version));
      if (state.status === "failed") return this.fail(id, state.failure_reason ?? "the process could not start");
      row = await records.transition(id, { process_id: state.pid, started_at: state.started_at ?? now });
    } catch (err) {
      log.error({ err, service_id: id }, "starting a service process failed");
      return this.fail(id, "the process could not be started in its machine");
    }
    this.watch(row, readiness);
    return row;
  }

  /**
   * stopping → stopped: the process ends, then its machine is destroyed. A failed service keeps its status. A replica
   * whose machine runs on another host (not lost) is stopped by that host, which supervises it.
   */
  async stopReplica(id: string): Promise<ServiceRow> {
    const { machines, records, log, edge, spread } = this.#d;
    const current = await records.loadService(id);
    const owner = current.status === "stopped" ? undefined : await spread.remoteOwner(current.machine_id);
    if (owner) return spread.stopOn(owner, id);
    return this.#d.locks.run(id, async () => {
      this.#supervisor.unwatch(id);
      this.probes.forget(id);
      let row = await records.loadService(id);
      if (row.status === "stopped") return row;
      const failed = row.status === "failed";
      if (!failed) row = await records.transition(id, { status: "stopping" });
      edge.dropTunnels(id);
      try {
        const { agent } = await machines.agentOf(row.machine_id);
        await agent.stopService(id).catch(() => undefined);
      } catch {
        // the machine is already gone
      }
      await machines.destroy(row.machine_id).catch((err: unknown) => {
        if (!(err instanceof KilnError && err.code === "not_found")) log.error({ err, service_id: id }, "destroying a service's machine failed");
      });
      this.#leases.forget(row.machine_id);
      this.#peerEnvs.delete(id);
      if (failed) return row;
      return records.transition(id, { status: "stopped", process_id: null, stopped_at: new Date().toISOString() });
    });
  }

  close(): void {
    this.#supervisor.close();
  }
}
