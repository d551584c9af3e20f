// Machine records: the statuses and bounds of SPEC.md, the machine view the API shows, and the one path that writes
// a machine's state change together with its lifecycle event (and tells attached streams the status changed).

import { EventEmitter } from "node:events";
import { BASE_USER } from "../builder/base-template.ts";
import type { Db, MachineRow, MachineUpdate } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import { DEFAULT_DISK_MB } from "../runtime/driver.ts";
import type { EgressRules, HibernateMode } from "../runtime/driver.ts";
import { announceDeliveries, recordEvent } from "../webhooks/outbox.ts";

export const MACHINE_STATUSES = ["creating", "running", "hibernated", "destroyed", "failed"] as const;
export type MachineStatus = (typeof MACHINE_STATUSES)[number];
export const LIFECYCLE_OPERATIONS = ["create", "update", "hibernate", "resume", "destroy", "snapshot", "fork"] as const;
export type LifecycleOperation = (typeof LIFECYCLE_OPERATIONS)[number];

export const MACHINE_DEFAULTS = { user: BASE_USER, timeoutS: 300, vcpus: 1, memoryMb: 1024, diskMb: DEFAULT_DISK_MB, internet: true } as const;
export const HIBERNATE_MODES = ["freeze", "disk", "memory"] as const satisfies readonly HibernateMode[];
export const ON_TIMEOUT = ["destroy", "hibernate"] as const;
export type OnTimeout = (typeof ON_TIMEOUT)[number];
/** How long a machine with on_timeout "hibernate" may sleep before it is destroyed, unless KILN_MAX_HIBERNATION_S says. */
export const DEFAULT_MAX_HIBERNATION_S = 30 * 24 * 3600;
/** Schema bounds; the host's own size and KILN_MAX_DISK_MB narrow them further at admission. */
export const MACHINE_LIMITS = { maxTimeoutS: 7 * 24 * 3600, maxVcpus: 64, minMemoryMb: 64, maxMemoryMb: 262_144, minDiskMb: 128, maxDiskMb: 16 * 1024 * 1024, maxCidrs: 256 } as const;

/** Said in failure_reason when the driver tells that a machine died of memory. */
export const OUT_OF_MEMORY = "out of memory";

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
    on_timeout: (row.on_timeout ?? "destroy") as OnTimeout,
    auto_resume: row.auto_resume === 1,
    hibernate_mode: row.status === "hibernated" ? ((row.hibernate_mode ?? "freeze") as HibernateMode) : null,
    snapshot_id: row.snapshot_id ?? null,
    host_id: row.host_id ?? null,
  };
}
export type MachineView = ReturnType<typeof machineView>;

function networkView(json: string | null): { allow_out: string[]; deny_out: string[] } {
  const rules = json ? (JSON.parse(json) as EgressRules) : undefined;
  return { allow_out: rules?.allowOut ?? [], deny_out: rules?.denyOut ?? [] };
}

/** Hibernated to disk or with its memory saved: no process of it runs on the host. */
export function stoppedHibernation(row: { status: string; hibernate_mode?: string | null }): boolean {
  return row.status === "hibernated" && (row.hibernate_mode === "disk" || row.hibernate_mode === "memory");
}

export class MachineRecords {
  readonly #db: Db;
  /** Tells streams (WebSockets) attached to a machine that its execution changed under them. */
  readonly #statusChanges = new EventEmitter<{ status: [id: string, status: MachineStatus] }>();

  constructor(db: Db) {
    this.#db = db;
    this.#statusChanges.setMaxListeners(0);
  }

  async load(id: string): Promise<MachineRow> {
    const row = await this.#db.selectFrom("machines").selectAll().where("id", "=", id).executeTakeFirst();
    if (!row) throw new KilnError("not_found", `No machine ${id}`);
    return row;
  }

  /** Applies a state change and records its lifecycle event in the same transaction. */
  async transition(id: string, set: MachineUpdate, operation: LifecycleOperation | null): Promise<MachineRow> {
    const db = this.#db;
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
      if (set.status) this.#statusChanges.emit("status", id, set.status as MachineStatus);
      if (queued > 0) announceDeliveries(db);
      return row;
    });
  }

  /** Records a lifecycle event of a machine that changes no field of it (snapshot, fork). */
  async recordLifecycle(id: string, operation: LifecycleOperation, extra: Record<string, unknown>): Promise<void> {
    const db = this.#db;
    const now = new Date().toISOString();
    const queued = await db.transaction().execute(async (tx) => {
      const row = await tx.selectFrom("machines").selectAll().where("id", "=", id).executeTakeFirstOrThrow();
      const eventId = newId("evt");
      const payload = { id: eventId, operation, occurred_at: now, machine: machineView(row), ...extra };
      return recordEvent(tx, { id: eventId, operation, occurredAt: now, payload, machineId: id });
    });
    if (queued > 0) announceDeliveries(db);
  }

  onStatus(listener: (id: string, status: MachineStatus) => void): () => void {
    this.#statusChanges.on("status", listener);
    return () => this.#statusChanges.off("status", listener);
  }
}
