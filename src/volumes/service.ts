// Volumes: create (an ext4 image of the asked size, mounted on the host), list, get, delete (refused while a live
// machine mounts it), the mounts a machine asks for at create, and each volume's data plane (files and watches).

import { EventEmitter } from "node:events";
import { createKeyedLock } from "../keyed-lock.ts";
import { posix } from "node:path";
import { mkdir, readdir, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import type { Readable } from "node:stream";
import type { HostRow } from "../store/schema.ts";
import type { ClusterAuth } from "../hosts/cluster-auth.ts";
import { INCOMING_PREFIX, imageDigest, receiveImage, sendImage } from "./move.ts";
import type { Db, VolumeRow } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import type { Logger } from "../log.ts";
import { createVolumeStorage, destroyVolumeStorage, hostFreeBytes, mountVolumeStorage, unmountVolumeStorage, volumePaths } from "./storage.ts";
import { localDataPlane } from "./data-plane.ts";
import type { DataPlane } from "./data-plane.ts";
import { newestFirstPage } from "../store/pages.ts";
import type { PageKey } from "../store/pages.ts";

export const VOLUME_STATUSES = ["creating", "ready", "deleting"] as const;
export type VolumeStatus = (typeof VOLUME_STATUSES)[number];
export const VOLUME_LIMITS = { minSizeMb: 16, maxSizeMb: 1_048_576, defaultSizeMb: 1024, maxPerMachine: 16 } as const;
/** Machine states in which a machine holds its volumes mounted. */
const LIVE_MACHINE_STATUSES = ["creating", "running", "hibernated"];
/** Guest paths a volume may not cover: the platform's own mounts and the kernel's file systems. */
const RESERVED_GUEST_PATHS = ["/proc", "/sys", "/dev", "/opt/kiln", "/run/kiln", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf"];

export interface VolumeMountRequest {
  volume_id: string;
  path: string;
  read_only?: boolean;
}

export interface VolumeMount {
  hostPath: string;
  guestPath: string;
  readOnly: boolean;
}

export function volumeView(row: VolumeRow) {
  return { id: row.id, name: row.name, size_mb: row.size_mb, status: row.status as VolumeStatus, created_at: row.created_at, updated_at: row.updated_at, host_id: row.host_id ?? null };
}
export type VolumeView = ReturnType<typeof volumeView>;

export interface VolumeService {
  create(input: { name: string; size_mb?: number }): Promise<VolumeView>;
  get(id: string): Promise<VolumeView>;
  /** Newest first by (created_at, id); `after` is the key of the last row of the previous page. */
  list(opts: { limit: number; after?: PageKey }): Promise<{ volumes: VolumeView[]; last: PageKey | undefined; more: boolean }>;
  remove(id: string): Promise<void>;
  /** Checks and records a machine's volume mounts before its row exists; answers where each mounts. */
  attach(machineId: string, requests: VolumeMountRequest[]): Promise<VolumeMount[]>;
  resolveDataPlane(id: string): Promise<DataPlane>;
  onDeleted(listener: (id: string) => void): () => void;
  start(): Promise<{ mounted: number; cleaned: number }>;
  close(): Promise<void>;
  /** Machines that hold the volume mounted now. */
  liveMachinesOf(id: string): Promise<string[]>;
  /** The volumes each of `machineIds` mounts (volume id and name, guest path), in path order; one query. */
  mountsOf(machineIds: string[]): Promise<Map<string, MachineVolumeMount[]>>;
  /** On a store shared by hosts: how this host reaches the others (moving a volume). */
  connectCluster(cluster: { auth: ClusterAuth; hosts: () => Promise<Map<string, HostRow>> }): void;
  /** Moves an unmounted volume this host holds to another host (docs/volumes.md). */
  move(id: string, hostId: string): Promise<VolumeView>;
  /** Takes a volume's image another host sends (it stays that host's until it switches the record). */
  receive(id: string, from: string, body: Readable, bytes: number, digest: string): Promise<void>;
}

export interface MachineVolumeMount {
  volume_id: string;
  name: string;
  path: string;
  read_only: boolean;
}

export function createVolumeService(deps: {
  db: Db;
  dataDir: string;
  log: Logger;
  /** This server's host: the volumes it makes are recorded there, and it mounts only those (docs/hosts.md). */
  hostId?: string;
  /**
   * Resolves once destroyed machines among `ids` have had their remains removed (machines/teardown.ts): a machine's
   * DELETE answers before its bind of the volume is unmounted, and the volume's storage must not go from under it.
   */
  machinesCleaned?: (ids: string[]) => Promise<void>;
}): VolumeService {
  const { db, dataDir, log } = deps;
  const planes = new Map<string, DataPlane>();
  let cluster: { auth: ClusterAuth; hosts: () => Promise<Map<string, HostRow>> } | undefined;
  const locks = createKeyedLock();
  const deletions = new EventEmitter<{ deleted: [id: string] }>();
  deletions.setMaxListeners(0);

  /** Serialises create-time attachment and deletion of one volume, so a delete never races a machine mounting it. */
  const withLock = locks.run;

  function ownedHere(row: VolumeRow): boolean {
    return row.host_id === null || deps.hostId === undefined || row.host_id === deps.hostId;
  }

  async function load(id: string): Promise<VolumeRow> {
    const row = /^vol_[a-z0-9]{26}$/.test(id) ? await db.selectFrom("volumes").selectAll().where("id", "=", id).executeTakeFirst() : undefined;
    if (!row || row.status === "deleting") throw new KilnError("not_found", `No volume ${id}`);
    return row;
  }

  async function create(input: { name: string; size_mb?: number }): Promise<VolumeView> {
    const sizeMb = input.size_mb ?? VOLUME_LIMITS.defaultSizeMb;
    const free = await hostFreeBytes(dataDir);
    if (sizeMb * 1024 * 1024 > free) {
      throw new KilnError("invalid_request", `size_mb ${sizeMb} is more than the host's free disk (${Math.floor(free / 1024 / 1024)} MiB)`);
    }
    const now = new Date().toISOString();
    const row: VolumeRow = { id: newId("vol"), name: input.name, size_mb: sizeMb, status: "creating", created_at: now, updated_at: now, host_id: deps.hostId ?? null };
    // Recorded first, so a crash half-way leaves a row that the next start cleans up rather than a stray image.
    await db.insertInto("volumes").values(row).execute();
    try {
      await createVolumeStorage(volumePaths(dataDir, row.id), sizeMb);
    } catch (err) {
      log.error({ err, volume_id: row.id }, "making a volume failed");
      await destroyVolumeStorage(volumePaths(dataDir, row.id)).catch(() => undefined);
      await db.deleteFrom("volumes").where("id", "=", row.id).execute();
      throw new KilnError("internal", "The volume could not be made", { cause: err });
    }
    const ready = { status: "ready", updated_at: new Date().toISOString() };
    await db.updateTable("volumes").set(ready).where("id", "=", row.id).execute();
    return volumeView({ ...row, ...ready });
  }

  async function get(id: string): Promise<VolumeView> {
    return volumeView(await load(id));
  }

  /** Newest first by (created_at, id); `after` is the key of the last row of the previous page. */
  async function list(opts: { limit: number; after?: [string, string] }) {
    const page = await newestFirstPage(db.selectFrom("volumes").selectAll().where("status", "=", "ready"), opts);
    return { volumes: page.rows.map(volumeView), last: page.last, more: page.more };
  }

  /** Machines that hold the volume mounted now (a mount recorded for a machine not yet inserted counts too). */
  async function mountsOf(machineIds: string[]): Promise<Map<string, MachineVolumeMount[]>> {
    const out = new Map<string, MachineVolumeMount[]>(machineIds.map((id) => [id, []]));
    if (machineIds.length === 0) return out;
    const rows = await db
      .selectFrom("machine_volumes")
      .innerJoin("volumes", "volumes.id", "machine_volumes.volume_id")
      .select(["machine_volumes.machine_id as machine_id", "machine_volumes.volume_id as volume_id", "volumes.name as name", "machine_volumes.path as path", "machine_volumes.read_only as read_only"])
      .where("machine_volumes.machine_id", "in", machineIds)
      .orderBy("machine_volumes.path")
      .execute();
    for (const r of rows) out.get(r.machine_id)?.push({ volume_id: r.volume_id, name: r.name, path: r.path, read_only: Number(r.read_only) === 1 });
    return out;
  }

  async function liveMachinesOf(id: string): Promise<string[]> {
    const rows = await db
      .selectFrom("machine_volumes")
      .leftJoin("machines", "machines.id", "machine_volumes.machine_id")
      .select(["machine_volumes.machine_id as machine_id", "machines.status as status"])
      .where("machine_volumes.volume_id", "=", id)
      .execute();
    return [...new Set(rows.filter((r) => r.status === null || LIVE_MACHINE_STATUSES.includes(r.status)).map((r) => r.machine_id))];
  }

  async function remove(id: string): Promise<void> {
    await withLock(id, async () => {
      await load(id);
      const holders = await liveMachinesOf(id);
      if (holders.length > 0) {
        throw new KilnError("conflict", `Volume ${id} is mounted by ${holders.length} live machine(s); destroy them first`, { detail: { details: { machine_ids: holders } } });
      }
      const mounted = await db.selectFrom("machine_volumes").select("machine_id").where("volume_id", "=", id).execute();
      await deps.machinesCleaned?.(mounted.map((r) => r.machine_id));
      await db.updateTable("volumes").set({ status: "deleting", updated_at: new Date().toISOString() }).where("id", "=", id).execute();
      await finishDelete(id);
    });
  }

  /** Closes the volume's watches, releases its mount and loop device, and forgets it. Safe to run again. */
  async function finishDelete(id: string) {
    deletions.emit("deleted", id);
    const plane = planes.get(id);
    planes.delete(id);
    await plane?.close();
    await destroyVolumeStorage(volumePaths(dataDir, id));
    await db.transaction().execute(async (tx) => {
      await tx.deleteFrom("machine_volumes").where("volume_id", "=", id).execute();
      await tx.deleteFrom("volumes").where("id", "=", id).execute();
    });
  }

  /**
   * Checks and records the volumes a machine being created asks for, and returns the bind mounts for its driver.
   * Recorded before the machine boots, so from here on a delete of any of them answers 409.
   */
  async function attach(machineId: string, requests: VolumeMountRequest[]): Promise<VolumeMount[]> {
    if (requests.length > VOLUME_LIMITS.maxPerMachine) throw new KilnError("invalid_request", `A machine mounts at most ${VOLUME_LIMITS.maxPerMachine} volumes`);
    const guestPaths = new Map<VolumeMountRequest, string>();
    for (const r of requests) {
      const p = checkGuestPath(r.path);
      if ([...guestPaths.values()].includes(p)) throw new KilnError("invalid_request", `Two volumes are mounted at ${p}`);
      guestPaths.set(r, p);
    }
    const mounts: VolumeMount[] = [];
    try {
      for (const r of requests) {
        const mount = await withLock(r.volume_id, async () => {
          const row = await load(r.volume_id).catch((err: unknown) => {
            throw err instanceof KilnError && err.code === "not_found" ? new KilnError("invalid_request", `No volume ${r.volume_id}`) : err;
          });
          // Placement sends a create that mounts volumes to their host; one that reaches another host is refused.
          if (!ownedHere(row)) throw new KilnError("conflict", `Volume ${row.id} lives on host ${row.host_id}; a machine mounting it runs there (send the create to any server: placement routes it)`);
          const paths = volumePaths(dataDir, row.id);
          await mountVolumeStorage(paths);
          const guestPath = guestPaths.get(r)!;
          await db.insertInto("machine_volumes").values({ machine_id: machineId, volume_id: row.id, path: guestPath, read_only: r.read_only ? 1 : 0, created_at: new Date().toISOString() }).execute();
          return { hostPath: paths.mount, guestPath, readOnly: r.read_only === true };
        });
        mounts.push(mount);
      }
    } catch (err) {
      // The machine will not be made: its half-recorded mounts must not hold the volumes.
      await db.deleteFrom("machine_volumes").where("machine_id", "=", machineId).execute();
      throw err;
    }
    return mounts;
  }

  /**
   * The host that serves a volume's files and watches. One host here: this one. A deployment with several hosts
   * looks up where the volume lives and returns a plane that routes there; every subscription asks afresh.
   */
  async function resolveDataPlane(id: string): Promise<DataPlane> {
    const known = planes.get(id);
    if (known) return known;
    // Under the volume's lock: a plane is never made for a volume whose delete is under way.
    return withLock(id, async () => {
      const row = await load(id);
      // Its image is in another host's data dir: a route that is not forwarded there (E2B's volume content API, or a
      // volume whose host is lost) must not try to mount it here (that left directories behind and answered 500).
      if (!ownedHere(row)) throw new KilnError("conflict", `Volume ${row.id} lives on host ${row.host_id}; its files are served by that host's server`, { detail: { details: { host_id: row.host_id } } });
      let plane = planes.get(id);
      if (!plane) {
        const paths = volumePaths(dataDir, id);
        await mountVolumeStorage(paths);
        await mkdir(paths.watchRoot, { recursive: true, mode: 0o700 });
        plane = localDataPlane({ mountPath: paths.mount, stagingDir: paths.watchRoot, log: log.child({ volume_id: id }) });
        planes.set(id, plane);
      }
      return plane;
    });
  }

  function onDeleted(listener: (id: string) => void): () => void {
    deletions.on("deleted", listener);
    return () => deletions.off("deleted", listener);
  }

  /**
   * Moves an unmounted volume to another active host: refused (409) while a machine mounts it; under the volume's
   * lock (no mount, file plane or delete meanwhile) its host mount is released, the image hashed and streamed to
   * the target, which checks size and digest, keeps it and switches the record to itself in one conditional update
   * before it answers; this host then removes its copy. A failure before the switch mounts it here again.
   */
  async function move(id: string, target: string): Promise<VolumeView> {
    if (!cluster || deps.hostId === undefined) throw new KilnError("conflict", "This server shares its store with no other host: there is nowhere to move a volume to");
    const { auth, hosts } = cluster;
    return withLock(id, async () => {
      const row = await load(id);
      if (row.status !== "ready") throw new KilnError("conflict", `Volume ${id} is ${row.status}`);
      if (row.host_id === target) return volumeView(row);
      if (!ownedHere(row)) throw new KilnError("conflict", `Volume ${id} lives on host ${row.host_id}; it is moved by that host's server`);
      const host = (await hosts()).get(target);
      if (!host) throw new KilnError("not_found", `No host ${target}`);
      if (host.status !== "active") throw new KilnError("conflict", `Host ${target} is ${host.status}: a volume moves only to an active host`);
      const holders = await liveMachinesOf(id);
      if (holders.length > 0) throw new KilnError("conflict", `Volume ${id} is mounted by ${holders.length} live machine(s); it moves only unmounted`, { detail: { details: { machine_ids: holders } } });
      // Destroyed machines' binds of it are unmounted before its host mount goes.
      const mounted = await db.selectFrom("machine_volumes").select("machine_id").where("volume_id", "=", id).execute();
      await deps.machinesCleaned?.(mounted.map((r) => r.machine_id));
      const paths = volumePaths(dataDir, id);
      const plane = planes.get(id);
      planes.delete(id);
      await plane?.close();
      await unmountVolumeStorage(paths);
      const started = Date.now();
      try {
        const bytes = (await stat(paths.image)).size;
        const digest = await imageDigest(paths.image);
        await sendImage(auth, { id: host.id, url: host.advertise_url }, id, paths.image, bytes, digest);
        log.info({ volume_id: id, to: target, bytes, digest, ms: Date.now() - started }, "volume moved to another host");
      } catch (err) {
        // The target may have switched the record and then failed to answer: the record decides whose copy this is.
        const now = await db.selectFrom("volumes").select("host_id").where("id", "=", id).executeTakeFirst();
        if (now?.host_id !== target) {
          await mountVolumeStorage(paths).catch((e: unknown) => log.error({ err: e, volume_id: id }, "mounting a volume again after a failed move failed"));
          throw err;
        }
      }
      // The record names the target now: this copy is stray (a crash here leaves it to the next start's sweep).
      await destroyVolumeStorage(paths).catch((err: unknown) => log.warn({ err, volume_id: id }, "removing a moved volume's old copy failed; the next start removes it"));
      return volumeView(await load(id));
    });
  }

  /**
   * Takes a volume's image from `from`, the host that holds it now (the cluster signature says who sent it), and
   * becomes its host: the record switches only if it still names `from`, else the copy goes and the answer is 409.
   */
  async function receive(id: string, from: string, body: Readable, bytes: number, digest: string): Promise<void> {
    await withLock(id, async () => {
      const row = await load(id);
      if (deps.hostId === undefined || row.host_id !== from) throw new KilnError("conflict", `Volume ${id} lives on host ${row.host_id}, not on the host that sent it`);
      if (row.status !== "ready") throw new KilnError("conflict", `Volume ${id} is ${row.status}`);
      if (bytes !== row.size_mb * 1024 * 1024) throw new KilnError("invalid_request", `Volume ${id}'s image is ${row.size_mb} MiB, not ${bytes} bytes`);
      const free = await hostFreeBytes(dataDir);
      if (bytes > free) throw new KilnError("unavailable", `This host has ${Math.floor(free / 1024 / 1024)} MiB free, less than volume ${id}'s ${row.size_mb} MiB`);
      // A copy left by an earlier move that did not finish is not this host's: replaced whole.
      const paths = volumePaths(dataDir, id);
      await destroyVolumeStorage(paths);
      await receiveImage(body, paths, join(dataDir, "volumes"), bytes, digest);
      const switched = await db.updateTable("volumes").set({ host_id: deps.hostId, updated_at: new Date().toISOString() }).where("id", "=", id).where("host_id", "=", from).where("status", "=", "ready").executeTakeFirst();
      if (Number(switched.numUpdatedRows) !== 1) {
        await destroyVolumeStorage(paths);
        throw new KilnError("conflict", `Volume ${id} changed while it was being moved`);
      }
      await mountVolumeStorage(paths);
    });
  }

  /**
   * Copies in the volumes dir that are not this host's (a move cut by a kill -9: the old owner's copy after the
   * switch, the target's before it) and temporary files of a receive, removed at start.
   */
  async function sweepStrays(): Promise<number> {
    if (deps.hostId === undefined) return 0;
    const dir = join(dataDir, "volumes");
    const names = await readdir(dir).catch(() => [] as string[]);
    let removed = 0;
    for (const name of names) {
      if (name.startsWith(INCOMING_PREFIX)) {
        await rm(join(dir, name), { force: true });
        removed++;
        continue;
      }
      if (!/^vol_[a-z0-9]{26}$/.test(name)) continue;
      const row = await db.selectFrom("volumes").select("host_id").where("id", "=", name).executeTakeFirst();
      // No row: a create or delete on this host finishes off its own (start, below); only another host's copy goes.
      if (!row || row.host_id === null || row.host_id === deps.hostId) continue;
      await destroyVolumeStorage(volumePaths(dataDir, name)).catch((err: unknown) => log.warn({ err, volume_id: name }, "removing a stray copy of another host's volume failed"));
      removed++;
    }
    if (removed > 0) log.info({ removed }, "stray volume copies removed (another host owns them)");
    return removed;
  }

  /** After a restart: ready volumes are mounted again where needed; half-made or half-deleted ones are finished off. */
  async function start(): Promise<{ mounted: number; cleaned: number }> {
    await sweepStrays().catch((err: unknown) => log.error({ err }, "looking for stray volume copies failed"));
    // Mounts recorded for a machine whose row never got written (a crash in between) hold nothing.
    const orphans = await db.selectFrom("machine_volumes").leftJoin("machines", "machines.id", "machine_volumes.machine_id").select("machine_volumes.machine_id as machine_id").where("machines.id", "is", null).execute();
    for (const o of orphans) await db.deleteFrom("machine_volumes").where("machine_id", "=", o.machine_id).execute();
    // Only this host's volumes: another host's data is in that host's data dir.
    const rows = (await db.selectFrom("volumes").selectAll().execute()).filter(ownedHere);
    let mounted = 0;
    let cleaned = 0;
    for (const row of rows) {
      try {
        if (row.status === "ready") {
          await mountVolumeStorage(volumePaths(dataDir, row.id));
          mounted++;
        } else {
          await finishDelete(row.id);
          cleaned++;
        }
      } catch (err) {
        log.error({ err, volume_id: row.id }, "restoring a volume after start failed");
      }
    }
    return { mounted, cleaned };
  }

  async function close() {
    await locks.drain();
    for (const plane of planes.values()) await plane.close();
    planes.clear();
  }

  return { create, get, list, remove, attach, resolveDataPlane, onDeleted, start, close, liveMachinesOf, mountsOf, connectCluster: (c) => (cluster = c), move, receive };
}

/** A guest mount point: absolute, normalised, not `/` and not over the platform's own mounts. */
function checkGuestPath(path: string): string {
  if (!path.startsWith("/") || path.includes("\0")) throw new KilnError("invalid_request", `A volume's path in the machine must be absolute: ${JSON.stringify(path)}`);
  const p = posix.normalize(path).replace(/\/+$/, "");
  if (p === "" || p === "/") throw new KilnError("invalid_request", "A volume cannot be mounted at /");
  for (const r of RESERVED_GUEST_PATHS) {
    if (p === r || p.startsWith(r + "/")) throw new KilnError("invalid_request", `A volume cannot be mounted at ${p}: ${r} belongs to the platform`);
  }
  return p;
}
