// Snapshots of machines: taken (disk, and memory under gVisor) while the machine goes on, listed, deleted, and
// turned into machines — one (`POST /v1/machines {snapshot}`) or many at once (fork). Records and files are
// reconciled at start so a crash leaves neither a half-made snapshot nor files no record names.

import type { Db, SnapshotRow, SnapshotUpdate } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import type { MachineDriver } from "../runtime/driver.ts";
import type { Logger } from "../log.ts";
import type { Admission } from "../machines/admission.ts";
import type { CreateMachineInput, MachineService, MachineView, SnapshotOrigin } from "../machines/service.ts";
import { checkMetadata } from "../machines/input-limits.ts";
import { newestFirstPage } from "../store/pages.ts";
import type { PageKey } from "../store/pages.ts";
import { snapshotView } from "./views.ts";
import type { SnapshotView } from "./views.ts";

export const SNAPSHOT_LIMITS = {
  /** Snapshots (ready or being made) one host keeps, unless KILN_MAX_SNAPSHOTS says. */
  defaultMaxPerHost: 1000,
  maxForkCount: 32,
  /** Children of one fork created at once: their boots share the host's cores. */
  forkConcurrency: 4,
} as const;

export interface SnapshotRequest {
  name?: string;
  memory?: boolean;
  metadata?: Record<string, string>;
}

export interface ForkRequest {
  count?: number;
  timeout_s?: number;
  metadata?: Record<string, string>;
  memory?: boolean;
}

export interface SnapshotService {
  /** The machine goes on as it was (running, or frozen); its snapshot is `ready` once its files are complete. */
  create(machineId: string, req: SnapshotRequest): Promise<SnapshotView>;
  /** A machine made from a snapshot: its shape defaults to the snapshot's, the request may change it. */
  createMachine(snapshotId: string, input: CreateMachineInput): Promise<MachineView>;
  /** A snapshot of the machine and `count` machines made from it, at once; all of them or none. */
  fork(machineId: string, req: ForkRequest): Promise<{ machines: MachineView[] }>;
  get(id: string): Promise<SnapshotView>;
  /** Newest first by (created_at, id); deleted and failed ones are not listed. */
  list(opts: { limit: number; after?: PageKey; machineId?: string }): Promise<{ snapshots: SnapshotView[]; last?: PageKey; more: boolean }>;
  /** Removes the snapshot's files at once; 409 only while a create or fork reads it. */
  remove(id: string): Promise<SnapshotView>;
  /** At start: snapshots a crash left half-made are failed, and files no ready snapshot names removed. */
  reconcile(): Promise<{ failed: number; removed: number }>;
  /** How many ready snapshots this host keeps and the bytes they hold (GET /v1/ready's capacity). */
  held(): Promise<{ count: number; bytes: number }>;
  /** A snapshot as a template build's base: its template artifact; 404/409 when it cannot be one here. */
  buildBase(id: string): Promise<{ id: string; artifactId: string; memory: boolean }>;
  /** Copies the files the snapshot's machine wrote to `destDir` (a template layer); a delete meanwhile is refused. */
  copyLayer(id: string, destDir: string): Promise<void>;
}

export function createSnapshotService(deps: {
  db: Db;
  driver: MachineDriver;
  machines: MachineService;
  admission?: Admission;
  log: Logger;
  hostId: string;
  maxSnapshots?: number;
}): SnapshotService {
  const { db, driver, machines, log, hostId } = deps;
  /** Creates and forks reading a snapshot's files right now: a delete waits for none of them, it is refused. */
  const inUse = new Map<string, number>();
  /** Memory snapshots their own machine is being restored from right now: a delete waits for that, it is not refused. */
  const restoring = new Map<string, Promise<void>>();

  async function load(id: string): Promise<SnapshotRow> {
    const row = await db.selectFrom("snapshots").selectAll().where("id", "=", id).executeTakeFirst();
    if (!row || row.internal === 1) throw new KilnError("not_found", `No snapshot ${id}`);
    return row;
  }

  /** The host's snapshots (ready or being taken) are under KILN_MAX_SNAPSHOTS, else a 409. */
  async function underCap(): Promise<void> {
    const max = deps.maxSnapshots ?? SNAPSHOT_LIMITS.defaultMaxPerHost;
    const held = await db.selectFrom("snapshots").select(db.fn.countAll<number>().as("n")).where("host_id", "=", hostId).where("status", "in", ["creating", "ready"]).executeTakeFirst();
    if (Number(held?.n ?? 0) >= max) throw new KilnError("conflict", `This host keeps at most ${max} snapshots (KILN_MAX_SNAPSHOTS); delete some first`);
  }

  /** Runs the cap's count and the new record's insert one request at a time (only this process writes its host's). */
  let admitting: Promise<unknown> = Promise.resolve();
  function admitOne(fn: () => Promise<void>): Promise<void> {
    const run = admitting.then(fn, fn);
    admitting = run.catch(() => undefined);
    return run;
  }

  async function update(id: string, set: SnapshotUpdate): Promise<SnapshotRow> {
    await db.updateTable("snapshots").set({ ...set, updated_at: new Date().toISOString() }).where("id", "=", id).execute();
    return db.selectFrom("snapshots").selectAll().where("id", "=", id).executeTakeFirstOrThrow();
  }

  /**
   * The machine goes on as it was (running, or frozen); its snapshot is `ready` once its files are complete. A memory
   * snapshot is answered then, before its machine is restored from it: `continued` settles once the machine runs
   * again. Until then the machine's lock is held (nothing else happens to it), requests for its agent wait, and the
   * snapshot's delete waits for it (the restore reads it).
   */
  function take(machineId: string, req: SnapshotRequest, internal = false): Promise<{ row: SnapshotRow; continued: Promise<void> }> {
    return new Promise((resolve, reject) => {
      takeLocked(machineId, req, internal, resolve).then(
        (row) => resolve({ row, continued: Promise.resolve() }),
        reject,
      );
    });
  }

  async function takeLocked(machineId: string, req: SnapshotRequest, internal: boolean, answer: (taken: { row: SnapshotRow; continued: Promise<void> }) => void): Promise<SnapshotRow> {
    checkMetadata(req.metadata);
    if (req.memory) {
      const why = driver.memorySnapshotsUnsupported();
      if (why) throw new KilnError("invalid_request", `Cannot snapshot memory on this host: ${why}`);
    }
    await deps.admission?.admitDisk();
    await underCap(); // refused at once, before waiting for the machine
    return machines.withMachine(machineId, async (m) => {
      if (req.memory && m.status !== "running") throw new KilnError("machine_not_running", `Machine ${machineId} is ${m.status}: only a running machine's memory can be saved`);
      const now = new Date().toISOString();
      const id = newId("snp");
      // Written before any file: a crash from here on leaves a `creating` record the next start cleans up. Counted
      // and written one request at a time, so concurrent requests (on one machine or several) cannot all pass the cap.
      await admitOne(async () => {
        await underCap();
        await db
          .insertInto("snapshots")
          .values({
            id,
            machine_id: m.id,
            template_id: m.template_id,
            artifact_id: m.artifact_id,
            name: req.name ?? null,
            memory: req.memory ? 1 : 0,
            status: "creating",
            size_bytes: 0,
            disk_mb: m.disk_mb,
            internet: m.internet,
            network_json: m.network_json,
            vcpus: m.vcpus,
            memory_mb: m.memory_mb,
            cwd: m.cwd,
            user: m.user,
            runtime: "",
            guest_runtime: "",
            disk_path: null,
            memory_path: null,
            metadata_json: JSON.stringify(req.metadata ?? {}),
            internal: internal ? 1 : 0,
            host_id: hostId,
            created_at: now,
            updated_at: now,
            deleted_at: null,
            failure_reason: null,
          })
          .execute();
      });
      try {
        const saved = await driver.snapshot(m.id, id, { memory: req.memory === true });
        const row = await update(id, { status: "ready", size_bytes: saved.sizeBytes, disk_path: saved.disk, memory_path: saved.memory, runtime: saved.runtime, guest_runtime: saved.guestRuntime });
        if (!saved.continued) return row;
        const continued = saved.continued;
        machines.continuing(m.id, continued);
        const settled = continued.catch(() => undefined);
        restoring.set(id, settled);
        void settled.then(() => restoring.delete(id));
        answer({ row, continued });
        // A machine that did not come back is found stopped by the health pass, which destroys it and says so.
        await continued.catch((err: unknown) => log.error({ err, machine_id: m.id, snapshot_id: id }, "the machine could not continue after its memory snapshot"));
        return row;
      } catch (err) {
        log.error({ err, machine_id: m.id, snapshot_id: id }, "taking a snapshot failed");
        await driver.deleteSnapshot(id).catch(() => undefined);
        await update(id, { status: "failed", failure_reason: "the snapshot could not be taken", deleted_at: new Date().toISOString() });
        throw err instanceof KilnError ? err : new KilnError("internal", "The snapshot could not be taken", { cause: err });
      }
    });
  }

  async function create(machineId: string, req: SnapshotRequest): Promise<SnapshotView> {
    const { row } = await take(machineId, req);
    const view = snapshotView(row);
    await machines.recordLifecycle(machineId, "snapshot", { snapshot: view });
    return view;
  }

  /** What a machine made from this snapshot starts from; 409 when the snapshot cannot be used here. */
  function origin(row: SnapshotRow): SnapshotOrigin {
    if (row.status !== "ready" || !row.disk_path) throw new KilnError("conflict", `Snapshot ${row.id} is ${row.status}`);
    if (row.host_id !== hostId) throw new KilnError("conflict", `Snapshot ${row.id} is kept on another host (${row.host_id})`);
    if (!driver.canRestoreSnapshot({ memory: row.memory_path, guestRuntime: row.guest_runtime })) {
      throw new KilnError("conflict", `Snapshot ${row.id} saved its machine's memory under a runtime this server does not run (${row.runtime}, or another guest runtime)`);
    }
    return { id: row.id, artifactId: row.artifact_id, disk: row.disk_path, memory: row.memory_path, diskMb: row.disk_mb, internet: row.internet === 1 };
  }

  /** Runs `fn` with the snapshot's files held: a delete meanwhile is refused. */
  async function using<T>(id: string, fn: () => Promise<T>): Promise<T> {
    inUse.set(id, (inUse.get(id) ?? 0) + 1);
    try {
      return await fn();
    } finally {
      const n = (inUse.get(id) ?? 1) - 1;
      if (n > 0) inUse.set(id, n);
      else inUse.delete(id);
    }
  }

  /** The machine's shape defaults to the snapshot's (vcpus, memory, network, cwd, user); the request may change it. */
  function inputFrom(row: SnapshotRow, input: CreateMachineInput): CreateMachineInput {
    const network = row.network_json ? (JSON.parse(row.network_json) as { allowOut: string[]; denyOut: string[] }) : undefined;
    return {
      vcpus: row.vcpus,
      memory_mb: row.memory_mb,
      internet: row.internet === 1,
      network: network ? { allow_out: network.allowOut, deny_out: network.denyOut } : undefined,
      cwd: row.cwd ?? undefined,
      user: row.user,
      ...Object.fromEntries(Object.entries(input).filter(([, v]) => v !== undefined)),
    };
  }

  async function createMachine(snapshotId: string, input: CreateMachineInput): Promise<MachineView> {
    if (input.template !== undefined) throw new KilnError("invalid_request", "Give either template or snapshot: a snapshot's machines have its template");
    if (input.volumes?.length && (await load(snapshotId)).memory === 1) throw new KilnError("invalid_request", "A machine continued from a memory snapshot cannot mount volumes its processes never had");
    const row = await load(snapshotId);
    return using(row.id, () => machines.create(inputFrom(row, input), origin(row)));
  }

  /** A snapshot of the machine and `count` machines made from it, at once; all of them or none. */
  async function fork(machineId: string, req: ForkRequest): Promise<{ machines: MachineView[] }> {
    const count = req.count ?? 1;
    checkMetadata(req.metadata);
    const { row: snap, continued } = await take(machineId, { memory: req.memory }, true);
    const made: MachineView[] = [];
    try {
      const queue = Array.from({ length: count }, (_, i) => i);
      const input = inputFrom(snap, { timeout_s: req.timeout_s, metadata: req.metadata });
      const next = async (): Promise<void> => {
        if (queue.shift() === undefined) return;
        made.push(await machines.create(input, origin(snap)));
        return next();
      };
      const runs = Array.from({ length: Math.min(SNAPSHOT_LIMITS.forkConcurrency, count) }, next);
      const results = await Promise.allSettled(runs);
      const failed = results.find((r) => r.status === "rejected");
      if (failed) throw (failed as PromiseRejectedResult).reason;
    } catch (err) {
      for (const m of made) await machines.destroy(m.id, "its fork failed").catch(() => undefined);
      throw err;
    } finally {
      // Each child has its own copy of the disk (and its processes restored): the fork's snapshot is done with once
      // the parent, too, is restored from it.
      await continued.catch(() => undefined);
      await driver.deleteSnapshot(snap.id).catch((err: unknown) => log.warn({ err, snapshot_id: snap.id }, "removing a fork's snapshot failed"));
      await update(snap.id, { status: "deleted", deleted_at: new Date().toISOString(), disk_path: null, memory_path: null });
    }
    made.sort((a, b) => (a.id < b.id ? -1 : 1));
    await machines.recordLifecycle(machineId, "fork", { machines: made.map((m) => m.id) });
    return { machines: made };
  }

  async function get(id: string): Promise<SnapshotView> {
    return snapshotView(await load(id));
  }

  /** Newest first by (created_at, id); deleted and failed ones are not listed. */
  async function list(opts: { limit: number; after?: PageKey; machineId?: string }) {
    let q = db.selectFrom("snapshots").selectAll().where("internal", "=", 0).where("status", "in", ["creating", "ready"]);
    if (opts.machineId) q = q.where("machine_id", "=", opts.machineId);
    const page = await newestFirstPage(q, opts);
    return { snapshots: page.rows.map(snapshotView), last: page.last, more: page.more };
  }

  /**
   * Removes the snapshot's files at once: machines made from it have their own copies, so none depends on it. Only a
   * create or fork reading it right now makes the delete 409 (try again).
   */
  async function remove(id: string): Promise<SnapshotView> {
    await restoring.get(id);
    const row = await load(id);
    if (row.status === "deleted" || row.status === "failed") return snapshotView(row);
    if (inUse.has(id)) throw new KilnError("conflict", `Snapshot ${id} is being copied into a new machine; try again when it is made`);
    if (row.host_id !== hostId) throw new KilnError("conflict", `Snapshot ${id} is kept on another host (${row.host_id})`);
    await driver.deleteSnapshot(id);
    return snapshotView(await update(id, { status: "deleted", deleted_at: new Date().toISOString(), disk_path: null, memory_path: null }));
  }

  /**
   * At start: snapshots a crash left `creating` are failed and their files removed, and files on this host that no
   * ready snapshot names (a crash between the copy and the record) are removed too.
   */
  async function reconcile(): Promise<{ failed: number; removed: number }> {
    // A fork's own snapshot still ready means the fork died with the server.
    const stale = await db
      .selectFrom("snapshots")
      .select("id")
      .where("host_id", "=", hostId)
      .where((eb) => eb.or([eb("status", "=", "creating"), eb.and([eb("status", "=", "ready"), eb("internal", "=", 1)])]))
      .execute();
    for (const { id } of stale) {
      await driver.deleteSnapshot(id);
      await update(id, { status: "failed", failure_reason: "the server stopped while the snapshot was being taken", deleted_at: new Date().toISOString() });
    }
    const ready = new Set((await db.selectFrom("snapshots").select("id").where("host_id", "=", hostId).where("status", "=", "ready").execute()).map((r) => r.id));
    let removed = 0;
    for (const id of await driver.listSnapshots()) {
      if (ready.has(id)) continue;
      await driver.deleteSnapshot(id);
      removed++;
    }
    return { failed: stale.length, removed };
  }

  // Compiled once: every readiness report runs it.
  const heldQuery = db
    .selectFrom("snapshots")
    .select([db.fn.countAll<number>().as("n"), db.fn.sum<number>("size_bytes").as("bytes")])
    .where("host_id", "=", hostId)
    .where("status", "=", "ready")
    .compile();

  /** How many ready snapshots this host keeps and the bytes they hold (GET /v1/ready's capacity). */
  async function held(): Promise<{ count: number; bytes: number }> {
    const row = (await db.executeQuery(heldQuery)).rows[0];
    return { count: Number(row?.n ?? 0), bytes: Number(row?.bytes ?? 0) };
  }

  /** Only the disk matters to a build: a memory snapshot is a base too (its processes are not carried over). */
  async function buildBase(id: string): Promise<{ id: string; artifactId: string; memory: boolean }> {
    const row = await load(id).catch((err: unknown) => {
      throw err instanceof KilnError && err.code === "not_found" ? new KilnError("not_found", `from_snapshot: no snapshot ${id}`) : err;
    });
    if (row.status !== "ready" || !row.disk_path) throw new KilnError("conflict", `from_snapshot: snapshot ${id} is ${row.status}`);
    if (row.host_id !== hostId) throw new KilnError("conflict", `from_snapshot: snapshot ${id} is kept on another host (${row.host_id}); build on that host`);
    return { id: row.id, artifactId: row.artifact_id, memory: row.memory === 1 };
  }

  async function copyLayer(id: string, destDir: string): Promise<void> {
    // Held before it is looked at again: deleted since the build was accepted is said so, not an internal error.
    await using(id, async () => driver.snapshotLayer((await buildBase(id)).id, destDir));
  }

  return { create, createMachine, fork, get, list, remove, reconcile, held, buildBase, copyLayer };
}

