// The deployment domain's rows: loading deployments, versions and services (404s in the API's words), and the one
// path that writes a service's change together with its status event and webhook deliveries.

import type { Db, DeploymentRow, DeploymentVersionRow, ServiceRow, ServiceUpdate } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import { announceDeliveries, recordEvent } from "../webhooks/outbox.ts";
import { SERVICE_EVENT_OPERATIONS } from "./lifecycle.ts";
import type { ServiceStatus } from "./lifecycle.ts";
import { serviceView } from "./views.ts";
import type { RolloutStatus } from "./views.ts";

export interface DeploymentRecords {
  loadDeployment(id: string): Promise<DeploymentRow>;
  loadVersion(id: string): Promise<DeploymentVersionRow>;
  /** A service, optionally checked to belong to a deployment (404 otherwise). */
  loadService(id: string, deploymentId?: string): Promise<ServiceRow>;
  /** The services of a deployment that run (starting, ready, unhealthy), oldest first. */
  activeServices(deploymentId: string): Promise<ServiceRow[]>;
  /**
   * Writes a service's change; a status change (or an explicit operation) is written as an event — with its webhook
   * deliveries — in the same transaction, its payload the service record without public_url (a URL with a token is
   * never stored).
   */
  transition(id: string, set: ServiceUpdate, operation?: string, extra?: (tx: Db, row: ServiceRow) => Promise<void>): Promise<ServiceRow>;
  setRollout(deploymentId: string, status: RolloutStatus, error: string | null): Promise<void>;
  /**
   * The replicas of one deployment whose machines ran on a lost host, ended once per cluster: under the
   * deployment's row lock (`FOR UPDATE SKIP LOCKED` on PostgreSQL: a server that finds it locked leaves it to the
   * one holding it), each by a conditional update with its event — a running one `failed` with the reason, a
   * stopping one `stopped` — and the deployment set rolling, its rollout this host's (`by`). Returns the replicas
   * this call ended (none: another server did, or does now).
   */
  claimLost(deploymentId: string, hostId: string, reason: string, by: string): Promise<ServiceRow[]>;
  /**
   * Takes over a rolling deployment's rollout from `from` (its recorded runner: a lost host, or null for a row made
   * before rollouts were recorded) for `to`: a conditional update, so one server wins. Whether this one did.
   */
  claimRollout(deploymentId: string, from: string | null, to: string): Promise<boolean>;
}

/** `written` hears every service row the transition wrote (the edge keeps its routes from it). */
export function createDeploymentRecords(db: Db, written: (row: ServiceRow) => void, opts: { rowLocks: boolean } = { rowLocks: false }): DeploymentRecords {
  /** A status change's event (and its deliveries) in the caller's transaction; how many deliveries it queued. */
  async function recordStatusEvent(tx: Db, after: ServiceRow, now: string, op: string): Promise<number> {
    const eventId = newId("evt");
    const payload = { id: eventId, operation: op, occurred_at: now, service: serviceView(after, null, JSON.parse(after.readiness_json)) };
    return recordEvent(tx, { id: eventId, operation: op, occurredAt: now, payload, machineId: after.machine_id });
  }

  return {
    async loadDeployment(id) {
      const row = await db.selectFrom("deployments").selectAll().where("id", "=", id).executeTakeFirst();
      if (!row) throw new KilnError("not_found", `No deployment ${id}`);
      return row;
    },

    async loadVersion(id) {
      return db.selectFrom("deployment_versions").selectAll().where("id", "=", id).executeTakeFirstOrThrow();
    },

    async loadService(id, deploymentId) {
      const row = await db.selectFrom("services").selectAll().where("id", "=", id).executeTakeFirst();
      if (!row || (deploymentId !== undefined && row.deployment_id !== deploymentId)) throw new KilnError("not_found", `No service ${id}${deploymentId ? ` in deployment ${deploymentId}` : ""}`);
      return row;
    },

    async activeServices(deploymentId) {
      return db.selectFrom("services").selectAll().where("deployment_id", "=", deploymentId).where("status", "in", ["starting", "ready", "unhealthy"]).orderBy("created_at").execute();
    },

    async transition(id, set, operation, extra) {
      const now = new Date().toISOString();
      let queued = 0;
      const row = await db.transaction().execute(async (tx) => {
        const before = await tx.selectFrom("services").select("status").where("id", "=", id).executeTakeFirstOrThrow();
        await tx.updateTable("services").set({ ...set, updated_at: now }).where("id", "=", id).execute();
        const after = await tx.selectFrom("services").selectAll().where("id", "=", id).executeTakeFirstOrThrow();
        const op = operation ?? (after.status !== before.status ? SERVICE_EVENT_OPERATIONS[after.status as ServiceStatus] : undefined);
        if (op) queued = await recordStatusEvent(tx, after, now, op);
        if (extra) await extra(tx, after);
        return after;
      });
      if (queued > 0) announceDeliveries(db);
      written(row);
      return row;
    },

    async claimLost(deploymentId, hostId, reason, by) {
      let queued = 0;
      const ended = await db.transaction().execute(async (tx) => {
        let lock = tx.selectFrom("deployments").select(["id", "status"]).where("id", "=", deploymentId);
        if (opts.rowLocks) lock = lock.forUpdate().skipLocked();
        const dep = await lock.executeTakeFirst();
        if (!dep) return [];
        const rows = await tx
          .selectFrom("services")
          .innerJoin("machines", "machines.id", "services.machine_id")
          .select(["services.id as id", "services.status as status"])
          .where("services.deployment_id", "=", deploymentId)
          .where("machines.host_id", "=", hostId)
          .where("services.status", "in", ["starting", "ready", "unhealthy", "stopping"])
          .execute();
        const out: ServiceRow[] = [];
        for (const r of rows) {
          const now = new Date().toISOString();
          const stopping = r.status === "stopping";
          const set: ServiceUpdate = stopping ? { status: "stopped", process_id: null, stopped_at: now, updated_at: now } : { status: "failed", failure_reason: reason, process_id: null, stopped_at: now, updated_at: now };
          const done = await tx.updateTable("services").set(set).where("id", "=", r.id).where("status", "=", r.status).executeTakeFirst();
          if (Number(done.numUpdatedRows) !== 1) continue;
          const after = await tx.selectFrom("services").selectAll().where("id", "=", r.id).executeTakeFirstOrThrow();
          queued += await recordStatusEvent(tx, after, now, SERVICE_EVENT_OPERATIONS[after.status as ServiceStatus]);
          out.push(after);
        }
        if (out.some((r) => r.status === "failed") && dep.status === "active") {
          await tx.updateTable("deployments").set({ rollout_status: "rolling", rollout_error: null, rollout_host_id: by, updated_at: new Date().toISOString() }).where("id", "=", deploymentId).execute();
        }
        return out;
      });
      if (queued > 0) announceDeliveries(db);
      for (const row of ended) written(row);
      return ended;
    },

    async claimRollout(deploymentId, from, to) {
      let q = db.updateTable("deployments").set({ rollout_host_id: to, updated_at: new Date().toISOString() }).where("id", "=", deploymentId).where("status", "=", "active").where("rollout_status", "=", "rolling");
      q = from === null ? q.where("rollout_host_id", "is", null) : q.where("rollout_host_id", "=", from);
      return Number((await q.executeTakeFirst()).numUpdatedRows) === 1;
    },

    async setRollout(deploymentId, status, error) {
      await db.updateTable("deployments").set({ rollout_status: status, rollout_error: error, updated_at: new Date().toISOString() }).where("id", "=", deploymentId).execute();
    },
  };
}
