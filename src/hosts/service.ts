// The hosts of one store: each server registers its own at start and heartbeats; any server answers the hosts list,
// drains and activates hosts, and marks a host whose heartbeat stopped `lost` — once per cluster, by a conditional
// update only one server wins — failing the machines it ran with the reason (their lifecycle webhooks fire once).

import { sql } from "kysely";
import type { Db, HostRow } from "../store/schema.ts";
import type { Logger } from "../log.ts";
import { KilnError } from "../errors.ts";
import { machineView } from "../machines/records.ts";
import { newId } from "../store/ids.ts";
import { storedSecret } from "../store/secrets.ts";
import { announceDeliveries, recordEvent } from "../webhooks/outbox.ts";

export const HOST_STATUSES = ["active", "draining", "lost"] as const;
export type HostStatus = (typeof HOST_STATUSES)[number];

/** What admission enforces on a host, as its heartbeat last reported it (GET /v1/ready's numbers). */
export interface HostCapacity {
  cores: number;
  memory_mb: number;
  mem_available_mb: number;
  min_free_memory_mb: number;
  free_disk_mb: number | null;
  min_free_disk_mb: number;
  max_disk_mb: number;
  live_machines: number;
  accepting: boolean;
  /**
   * Booted machines its warm pools hold ready, by what they are for: `base` (each host makes its own base template)
   * or a hot template's artifact id. Placement prefers a host that can hand one out.
   */
  warm_ready?: Record<string, number>;
}

export interface HostView {
  id: string;
  name: string;
  advertise_url: string;
  status: HostStatus;
  capacity: HostCapacity;
  heartbeat_at: string;
  started_at: string;
  created_at: string;
  lost_at: string | null;
  /** Whether this is the host of the server that answered. */
  self: boolean;
}

/** Machine statuses that hold a host's resources: what a lost host's machines are failed from. */
const LIVE = ["creating", "running", "hibernated"] as const;
/** Machines failed per statement when a host is lost (each its own event, in one transaction per batch). */
const FAIL_BATCH = 100;
/** The peers table is read at most this often for forwarding and placement (a heartbeat refreshes it too). */
const PEERS_TTL_MS = 1000;

export interface HostServiceDeps {
  db: Db;
  log: Logger;
  hostId: string;
  name: string;
  /** The capacity this host reports at each heartbeat. */
  capacity: () => Promise<HostCapacity>;
  lostAfterS: number;
  heartbeatMs: number;
  /** Called with this host's status when it is first read and whenever it changes (draining releases the warm pool). */
  onStatus?: (status: HostStatus) => void;
  /** What else a lost host leaves to end (its builds); called by whoever sweeps, idempotent. */
  onLost?: (host: { id: string; name: string; lost_at: string | null }, reason: string) => Promise<void>;
}

export function lostReason(host: { id: string; name: string }, lostAfterS: number): string {
  return `host ${host.name} (${host.id}) was lost: no heartbeat for ${lostAfterS} s`;
}

export function createHostService(deps: HostServiceDeps) {
  const { db, log, hostId, lostAfterS } = deps;
  let advertiseUrl = "";
  let timer: NodeJS.Timeout | undefined;
  let beating: Promise<void> | undefined;
  let peers: { at: number; rows: Map<string, HostRow> } = { at: 0, rows: new Map() };
  let ownStatus: string | undefined;
  /** Whether another host that is not lost was registered at the last read of the hosts (heartbeat or peers table). */
  let others = false;

  /** Tells onStatus when this host's status (as the store says, whoever changed it) is new. */
  function sawOwnStatus(status: string | undefined) {
    if (status === undefined || status === ownStatus) return;
    ownStatus = status;
    deps.onStatus?.(status as HostStatus);
  }

  function view(row: HostRow): HostView {
    return {
      id: row.id,
      name: row.name,
      advertise_url: row.advertise_url,
      status: row.status as HostStatus,
      capacity: JSON.parse(row.capacity_json) as HostCapacity,
      heartbeat_at: row.heartbeat_at,
      started_at: row.started_at,
      created_at: row.created_at,
      lost_at: row.lost_at,
      self: row.id === hostId,
    };
  }

  /**
   * This host's row, made or brought back: a lost host that starts again is active (its old machines are failed
   * and adoption removes what it still runs); a draining one stays draining until someone activates it.
   */
  async function register(url: string): Promise<HostView> {
    advertiseUrl = url;
    const now = new Date().toISOString();
    const capacity = JSON.stringify(await deps.capacity());
    await db
      .insertInto("hosts")
      .values({ id: hostId, name: deps.name, advertise_url: url, status: "active", capacity_json: capacity, heartbeat_at: now, started_at: now, created_at: now, updated_at: now, lost_at: null })
      .onConflict((oc) =>
        oc.column("id").doUpdateSet({
          name: deps.name,
          advertise_url: url,
          capacity_json: capacity,
          heartbeat_at: now,
          started_at: now,
          updated_at: now,
          lost_at: null,
          status: sql<string>`case when hosts.status = 'draining' then 'draining' else 'active' end`,
        }),
      )
      .execute();
    peers.at = 0;
    await hosts();
    const self = await get(hostId);
    sawOwnStatus(self.status);
    return self;
  }

  /** One heartbeat: this host's time and capacity, then a look for hosts whose heartbeat stopped. */
  async function beat(): Promise<void> {
    const now = new Date().toISOString();
    const capacity = JSON.stringify(await deps.capacity());
    // A host marked lost while it was cut off from the store stays lost until it restarts: its machines were failed
    // and their records are final (docs/hosts.md).
    await db.updateTable("hosts").set({ heartbeat_at: now, capacity_json: capacity, updated_at: now }).where("id", "=", hostId).where("status", "!=", "lost").execute();
    await sweepLost();
    peers.at = 0;
    // Another server may have drained or activated this host: its own row says so at each heartbeat, and the others'
    // whether this host is alone on the store.
    const rows = await db.selectFrom("hosts").select(["id", "status"]).where((eb) => eb.or([eb("status", "!=", "lost"), eb("id", "=", hostId)])).execute();
    others = rows.some((r) => r.id !== hostId);
    sawOwnStatus(rows.find((r) => r.id === hostId)?.status);
  }

  /**
   * Hosts whose heartbeat is older than the bound become `lost`: the conditional update lets exactly one server
   * claim each; that server fails the lost host's machines. Machines of a host already lost but not yet failed
   * (the claimer died midway) are failed by whoever looks next, each machine once (a conditional update too).
   */
  async function sweepLost(): Promise<number> {
    const cutoff = new Date(Date.now() - lostAfterS * 1000).toISOString();
    const stale = await db.selectFrom("hosts").selectAll().where("status", "!=", "lost").where("heartbeat_at", "<", cutoff).where("id", "!=", hostId).execute();
    for (const host of stale) {
      const now = new Date().toISOString();
      const claimed = await db
        .updateTable("hosts")
        .set({ status: "lost", lost_at: now, updated_at: now })
        .where("id", "=", host.id)
        .where("status", "!=", "lost")
        .where("heartbeat_at", "<", cutoff)
        .executeTakeFirst();
      if (Number(claimed.numUpdatedRows) === 1) log.warn({ host_id: host.id, host_name: host.name, heartbeat_at: host.heartbeat_at }, "host lost: its heartbeat stopped; failing its machines");
    }
    let failed = 0;
    const lost = await db.selectFrom("hosts").select(["id", "name", "lost_at"]).where("status", "=", "lost").execute();
    for (const host of lost) {
      failed += await failMachinesOf(host);
      await deps.onLost?.(host, lostReason(host, lostAfterS));
    }
    return failed;
  }

  async function failMachinesOf(host: { id: string; name: string }): Promise<number> {
    const reason = lostReason(host, lostAfterS);
    let failed = 0;
    for (;;) {
      const rows = await db.selectFrom("machines").select("id").where("host_id", "=", host.id).where("status", "in", LIVE).limit(FAIL_BATCH).execute();
      if (rows.length === 0) break;
      let queued = 0;
      for (const { id } of rows) {
        const now = new Date().toISOString();
        queued += await db.transaction().execute(async (tx) => {
          const done = await tx
            .updateTable("machines")
            .set({ status: "failed", failure_reason: reason, destroyed_at: now, updated_at: now })
            .where("id", "=", id)
            .where("host_id", "=", host.id)
            .where("status", "in", LIVE)
            .executeTakeFirst();
          // Another server failed it first: its event is theirs.
          if (Number(done.numUpdatedRows) !== 1) return 0;
          failed++;
          const row = await tx.selectFrom("machines").selectAll().where("id", "=", id).executeTakeFirstOrThrow();
          const eventId = newId("evt");
          return recordEvent(tx, { id: eventId, operation: "destroy", occurredAt: now, payload: { id: eventId, operation: "destroy", occurred_at: now, machine: machineView(row) }, machineId: id });
        });
      }
      if (queued > 0) announceDeliveries(db);
      if (rows.length < FAIL_BATCH) break;
    }
    if (failed > 0) log.warn({ host_id: host.id, machines: failed }, "machines of a lost host marked failed");
    return failed;
  }

  function start(): void {
    timer = setInterval(() => {
      if (beating) return;
      beating = beat()
        .catch((err: unknown) => log.warn({ err }, "the host heartbeat failed"))
        .finally(() => (beating = undefined));
    }, deps.heartbeatMs);
    timer.unref();
  }

  async function close(): Promise<void> {
    clearInterval(timer);
    await beating;
  }

  async function list(): Promise<HostView[]> {
    const rows = await db.selectFrom("hosts").selectAll().orderBy("created_at").orderBy("id").execute();
    return rows.map(view);
  }

  async function get(id: string): Promise<HostView> {
    const row = await db.selectFrom("hosts").selectAll().where("id", "=", id).executeTakeFirst();
    if (!row) throw new KilnError("not_found", `Host ${id} not found`);
    return view(row);
  }

  /** Draining: no new machines are placed on the host; what runs there keeps running and answering. */
  async function setStatus(id: string, status: "active" | "draining"): Promise<HostView> {
    const row = await db.selectFrom("hosts").select("status").where("id", "=", id).executeTakeFirst();
    if (!row) throw new KilnError("not_found", `Host ${id} not found`);
    if (row.status === "lost") throw new KilnError("conflict", `Host ${id} is lost: it becomes active again when its server starts`);
    await db.updateTable("hosts").set({ status, updated_at: new Date().toISOString() }).where("id", "=", id).where("status", "!=", "lost").execute();
    peers.at = 0;
    const next = await get(id);
    if (id === hostId) sawOwnStatus(next.status);
    return next;
  }

  /** Every host row, read at most once a second: what forwarding and placement look hosts up in. */
  async function hosts(): Promise<Map<string, HostRow>> {
    if (Date.now() - peers.at < PEERS_TTL_MS) return peers.rows;
    const rows = await db.selectFrom("hosts").selectAll().execute();
    peers = { at: Date.now(), rows: new Map(rows.map((r) => [r.id, r])) };
    others = rows.some((r) => r.id !== hostId && r.status !== "lost");
    return peers.rows;
  }

  return {
    hostId,
    register,
    beat,
    sweepLost,
    start,
    close,
    list,
    get,
    drain: (id: string) => setStatus(id, "draining"),
    activate: (id: string) => setStatus(id, "active"),
    hosts,
    /**
     * Whether another host (not lost) shares the store, as of the last heartbeat or read of the hosts, whichever came
     * last: what lets a server alone on its store skip polling for other hosts' work.
     */
    hasPeers: () => others,
    /** This host's status as the store has it now (one read: another server may have drained it since the last heartbeat). */
    ownStatus: async () => (await db.selectFrom("hosts").select("status").where("id", "=", hostId).executeTakeFirst())?.status,
    advertiseUrl: () => advertiseUrl,
  };
}

export type HostService = ReturnType<typeof createHostService>;

/** The cluster's forwarding secret: made by the first server that needs it, read by every other (the store keeps it). */
export function clusterSecret(db: Db): Promise<Buffer> {
  return storedSecret(db, "forward");
}
