// Placement of new machines across the hosts of one store: active hosts only (draining and lost ones get nothing),
// whose heartbeat is fresh and whose admission floors still accept; those that already hold the template's layers
// (template locality) first, then fewest live machines (counting the creates this server is placing right now), then
// those with a warm machine ready for it, then the most memory above the floor.

import { sql } from "kysely";
import type { Db, HostRow } from "../store/schema.ts";
import type { HostCapacity } from "./service.ts";

const LIVE = ["creating", "running", "hibernated"] as const;

export function createPlacement(deps: { db: Db; hostId: string; lostAfterS: number; hosts: () => Promise<Map<string, HostRow>> }) {
  const { db, hostId } = deps;
  /** Creates this server forwarded and that have not been answered yet, per host. */
  const inFlight = new Map<string, number>();

  /**
   * The hosts a create may go to, best first. Empty: no host can take one now. `holders` hold the template's layers;
   * `warm` keys the warm machines made for it in each host's reported `warm_ready`.
   */
  async function candidates(holders?: Set<string>, warm?: string): Promise<HostRow[]> {
    const fresh = Date.now() - deps.lostAfterS * 1000;
    // A host's reported capacity, parsed once (the sort below asks for it on every comparison).
    const parsed = new Map<HostRow, HostCapacity>();
    const capacity = (h: HostRow) => parsed.get(h) ?? parsed.set(h, JSON.parse(h.capacity_json) as HostCapacity).get(h)!;
    const accepting = (h: HostRow) => capacity(h).accepting !== false;
    const usable = [...(await deps.hosts()).values()].filter((h) => {
      if (h.status !== "active") return false;
      // This host stays a candidate whatever its last heartbeat said: its own admission answers live, and says why.
      if (h.id === hostId) return true;
      if (Date.parse(h.heartbeat_at) < fresh) return false;
      return accepting(h);
    });
    if (usable.length <= 1) return usable;
    const counts = new Map(
      (await db.selectFrom("machines").select(["host_id", sql<number>`count(*)`.as("n")]).where("status", "in", LIVE).groupBy("host_id").execute()).map((r) => [r.host_id, Number(r.n)]),
    );
    const load = (h: HostRow) => (counts.get(h.id) ?? 0) + (inFlight.get(h.id) ?? 0);
    const headroom = (h: HostRow) => (capacity(h).mem_available_mb ?? 0) - (capacity(h).min_free_memory_mb ?? 0);
    const tiebreak = new Map(usable.map((h) => [h.id, Math.random()]));
    const local = (h: HostRow) => Number(holders?.has(h.id) ?? false);
    // A warm machine as of its last heartbeat, less the creates already on their way there: a handout, not a boot.
    const ready = (h: HostRow) => Number(warm !== undefined && (capacity(h).warm_ready?.[warm] ?? 0) > (inFlight.get(h.id) ?? 0));
    return usable.sort((a, b) => Number(accepting(b)) - Number(accepting(a)) || local(b) - local(a) || load(a) - load(b) || ready(b) - ready(a) || headroom(b) - headroom(a) || tiebreak.get(a.id)! - tiebreak.get(b.id)!);
  }

  /** Counts a create on its way to `id` until the returned function is called. */
  function hold(id: string): () => void {
    inFlight.set(id, (inFlight.get(id) ?? 0) + 1);
    let released = false;
    return () => {
      if (released) return;
      released = true;
      const n = (inFlight.get(id) ?? 1) - 1;
      if (n <= 0) inFlight.delete(id);
      else inFlight.set(id, n);
    };
  }

  /** The host a snapshot's files are on, when it is not lost (else undefined: the local create answers). */
  async function snapshotHost(snapshotId: string): Promise<HostRow | undefined> {
    const row = await db.selectFrom("snapshots").select("host_id").where("id", "=", snapshotId).executeTakeFirst();
    if (!row) return undefined;
    const host = (await deps.hosts()).get(row.host_id);
    return host && host.status !== "lost" ? host : undefined;
  }

  /** The host a volume's data is on, when it is not lost (else undefined: the local create answers, and judges it). */
  async function volumeHost(volumeId: string): Promise<HostRow | undefined> {
    const row = await db.selectFrom("volumes").select("host_id").where("id", "=", volumeId).executeTakeFirst();
    if (!row?.host_id) return undefined;
    const host = (await deps.hosts()).get(row.host_id);
    return host && host.status !== "lost" ? host : undefined;
  }

  return { candidates, hold, snapshotHost, volumeHost };
}

export type Placement = ReturnType<typeof createPlacement>;
