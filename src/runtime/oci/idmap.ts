// Machine ids on the host. Files at rest — template layers, captured build layers, machines' disks, volumes — are
// stored in one canonical range: machine id n is host id CANONICAL_BASE + n. Where the host allows idmapped mounts,
// each machine runs on its own range of host ids (from ID_POOL_END's pool) and sees those files through mounts
// that map the canonical range onto its own; elsewhere every machine runs on the canonical range itself.

/** Host id of machine id 0 in files at rest (and of every machine on hosts without idmapped mounts). */
export const CANONICAL_BASE = 100_000;
/** Ids per machine: 0–65535 inside, like a full 16-bit range. */
export const ID_RANGE = 65_536;
/** Machines' own ranges are CANONICAL_BASE + k·ID_RANGE for k ≥ 1, below this (build isolation takes ranges above). */
export const ID_POOL_END = 1_000_000_000;
/** The last pool index whose range ends at or below ID_POOL_END. */
export const ID_POOL_LAST = Math.floor((ID_POOL_END - CANONICAL_BASE) / ID_RANGE) - 1;

/** Kept for the callers that write files at rest (unpack, base template, volumes): the canonical range. */
export const HOST_ID_BASE = CANONICAL_BASE;

export function rangeBase(index: number): number {
  if (!Number.isInteger(index) || index < 1 || index > ID_POOL_LAST) throw new Error(`uid range ${index} is outside the pool`);
  return CANONICAL_BASE + index * ID_RANGE;
}

/** The pool index whose range holds host id `id`, or undefined outside the pool (the canonical range is index 0). */
export function rangeOf(id: number): number | undefined {
  if (id < CANONICAL_BASE || id >= CANONICAL_BASE + (ID_POOL_LAST + 1) * ID_RANGE) return undefined;
  return Math.floor((id - CANONICAL_BASE) / ID_RANGE);
}

/** How one machine runs on the host, decided at create and kept in its dir for every later boot. */
export interface MachineIdentity {
  /** Host uid/gid of machine id 0. */
  hostBase: number;
  /** The pool range the machine holds (its own ids, or only its namespace's owner on the shared range). */
  range?: number;
  /** Layers, disk and volumes are seen through idmapped mounts (canonical → hostBase). */
  idmapped: boolean;
  /** runc: the machine's user namespace is made by the mount helper and belongs to this host uid. */
  owner?: number;
}

/** A machine from before per-machine identities (no record in its dir): the shared range, no helper. */
export const SHARED_IDENTITY: MachineIdentity = { hostBase: CANONICAL_BASE, idmapped: false };
