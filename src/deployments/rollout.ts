// Rolling updates: bringing a deployment's services onto its current version one replica at a time, one rollout per
// deployment at once (a later one queues behind the running one), resumable after a restart. The deployment records
// which host's server runs its rollout (`rollout_host_id`); a rollout another server took over stops at its next step.

import type { Db } from "../store/schema.ts";
import { KilnError } from "../errors.ts";
import type { Logger } from "../log.ts";
import type { DeploymentRecords } from "./records.ts";
import type { ServiceSupervision } from "./supervision.ts";
import type { ReadinessDetail } from "./lifecycle.ts";

/** How long a rollout waits for a new replica to be ready before it gives up. */
const ROLLOUT_READY_TIMEOUT_MS = 5 * 60_000;

export class Rollouts {
  /** The rollout running (or queued last) for each deployment. */
  readonly #running = new Map<string, Promise<void>>();
  #closed = false;
  readonly #d: { db: Db; log: Logger; records: DeploymentRecords; supervision: ServiceSupervision; hostId: string };

  constructor(deps: { db: Db; log: Logger; records: DeploymentRecords; supervision: ServiceSupervision; hostId: string }) {
    this.#d = deps;
  }

  get closed(): boolean {
    return this.#closed;
  }

  /**
   * Brings a deployment's services onto its current version, one replica at a time: a new replica first, and an old
   * one stops only once the new one is ready, so some replica answers throughout. Safe to run again after a restart.
   */
  run(deploymentId: string, why?: ReadinessDetail): Promise<void> {
    const { log } = this.#d;
    const prev = this.#running.get(deploymentId) ?? Promise.resolve();
    const next = prev.then(() => this.#runNow(deploymentId, why)).catch((err: unknown) => log.error({ err, deployment_id: deploymentId }, "rollout failed"));
    this.#running.set(deploymentId, next);
    void next.then(() => {
      if (this.#running.get(deploymentId) === next) this.#running.delete(deploymentId);
    });
    return next;
  }

  /** Whether a rollout of the deployment runs (or is queued) on this server. */
  running(deploymentId: string): boolean {
    return this.#running.has(deploymentId);
  }

  /** Settles when the deployment's current rollout has (at once if none runs). */
  async settled(deploymentId: string): Promise<void> {
    await this.#running.get(deploymentId);
  }

  /** Stops starting new replicas and waits for every running rollout. */
  async close(): Promise<void> {
    this.#closed = true;
    await Promise.all([...this.#running.values()]);
  }

  /** Whether another host's server runs the deployment's rollout now (a PATCH there, or its lost-host replacements). */
  #takenOver(dep: { rollout_host_id: string | null }): boolean {
    return dep.rollout_host_id !== null && dep.rollout_host_id !== this.#d.hostId;
  }

  async #runNow(deploymentId: string, why?: ReadinessDetail): Promise<void> {
    try {
      await this.#steps(deploymentId, why);
    } catch (err) {
      this.#d.log.error({ err, deployment_id: deploymentId }, "rollout failed");
      await this.#d.records.setRollout(deploymentId, "failed", err instanceof KilnError ? err.message : "a replica could not be created");
    }
  }

  /** `why`: recorded in each new replica's readiness_status (a replacement for a lost host's replicas says so). */
  async #steps(deploymentId: string, why?: ReadinessDetail): Promise<void> {
    const { db, records, supervision } = this.#d;
    let dep = await records.loadDeployment(deploymentId);
    if (dep.status !== "active" || this.#takenOver(dep)) return;
    const version = await records.loadVersion(dep.current_version_id);
    await records.setRollout(deploymentId, "rolling", null);
    // Failed replicas of any version are replaced; their records stay for inspection.
    const services = await records.activeServices(deploymentId);
    const current = services.filter((s) => s.version_id === version.id);
    const old = services.filter((s) => s.version_id !== version.id);
    for (const s of current.slice(dep.replicas)) await supervision.stopReplica(s.id);
    let have = Math.min(current.length, dep.replicas);
    while (have < dep.replicas && !this.#closed) {
      dep = await records.loadDeployment(deploymentId);
      if (dep.status !== "active" || dep.current_version_id !== version.id || this.#takenOver(dep)) return; // a newer update, a delete or another server took over
      const fresh = await supervision.createReplica(dep, version, why);
      if (!(await this.#waitReady(fresh.id, deploymentId, version.id, ROLLOUT_READY_TIMEOUT_MS))) {
        const now = await records.loadDeployment(deploymentId);
        if (now.status !== "active" || now.current_version_id !== version.id) return; // the newer rollout replaces it
        const row = await records.loadService(fresh.id);
        await records.setRollout(deploymentId, "failed", `replica ${fresh.id} of version ${version.number} did not become ready (${row.failure_reason ?? row.status})`);
        return;
      }
      have++;
      const retire = old.shift();
      if (retire) await supervision.stopReplica(retire.id);
    }
    for (const s of old) await supervision.stopReplica(s.id);
    // Failed replicas of earlier versions kept their machines for their logs; once the new version serves, those go.
    const stale = await db.selectFrom("services").select("id").where("deployment_id", "=", deploymentId).where("status", "=", "failed").where("version_id", "!=", version.id).execute();
    for (const s of stale) await supervision.stopReplica(s.id);
    if (this.#closed || this.#takenOver(await records.loadDeployment(deploymentId))) return;
    await records.setRollout(deploymentId, "idle", null);
  }

  /** Waits until a service is ready (true) or failed/stopped/timed out (false), by reading its record. */
  async #waitReady(id: string, deploymentId: string, versionId: string, timeoutMs: number): Promise<boolean> {
    const { records } = this.#d;
    const deadline = Date.now() + timeoutMs;
    while (Date.now() < deadline && !this.#closed) {
      const dep = await records.loadDeployment(deploymentId);
      if (dep.status !== "active" || dep.current_version_id !== versionId) return false; // deleted or superseded meanwhile
      const row = await records.loadService(id);
      if (row.status === "ready") return true;
      if (row.status === "failed" || row.status === "stopped" || row.status === "stopping") return false;
      await new Promise((r) => setTimeout(r, 100));
    }
    return false;
  }
}
