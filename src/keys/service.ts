// API keys: made as `kiln_<random>` (or `e2b_<hex>` for the E2B SDK's key check), stored only as SHA-256 hashes,
// checked in constant time; revocation reaches every server on the store within a second (watchRevocations).
// Also seeds the first key on a fresh data dir (written to $KILN_DATA_DIR/api-key, never logged).

import { hash as digest, randomBytes, timingSafeEqual } from "node:crypto";
import { chmod, mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import type { Db } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import type { Logger } from "../log.ts";

const ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

export function generateKey(): string {
  // 40 base62 chars ≈ 238 bits; rejection sampling keeps every character uniform.
  let out = "";
  while (out.length < 40) {
    for (const b of randomBytes(64)) {
      if (b < 248 && out.length < 40) out += ALPHABET[b % 62];
    }
  }
  return `kiln_${out}`;
}

/** The key formats Kiln issues; `e2b` matches the E2B SDK's `^e2b_[0-9a-f]+$` check (160 random bits as hex). */
export const KEY_FORMATS = ["kiln", "e2b"] as const;
export type KeyFormat = (typeof KEY_FORMATS)[number];

/** What generateKeyIn makes, in either format. */
const ISSUED_KEY = /^(kiln_[0-9A-Za-z]{40}|e2b_[0-9a-f]{40})$/;

export function generateKeyIn(format: KeyFormat): string {
  return format === "e2b" ? `e2b_${randomBytes(20).toString("hex")}` : generateKey();
}

/** SHA-256 hex of a key: one-shot (every authenticated request hashes its key; a Hash object per call cost 2× as much). */
export function hashKey(key: string): string {
  return digest("sha256", key, "hex");
}

export interface KeySummary {
  id: string;
  name: string;
  prefix: string;
  created_at: string;
  last_used_at: string | null;
  revoked_at: string | null;
}

/** How often the store is asked whether any key was revoked (by another process or server); revocation takes this long at most. */
export const REVOCATION_POLL_MS = 500;
/** A verified key is remembered this long, but trusted only while the revocation poll is current (see verify). */
const VERIFIED_TTL_MS = 30_000;
/** Remembered verifications are not trusted when the last successful poll is older than this. */
const POLL_STALE_MS = 3000;

export interface KeyService {
  create(name: string, key?: string): Promise<KeySummary & { key: string }>;
  list(): Promise<KeySummary[]>;
  revoke(id: string): Promise<KeySummary>;
  verify(presented: string): string | null | Promise<string | null>;
  isActive(id: string): Promise<boolean>;
  isRevoked(id: string): boolean;
  onRevoked(fn: (ids: string[]) => void): () => void;
  watchRevocations(onError: (err: unknown) => void): Promise<() => void>;
  seed(opts: { apiKey?: string; dataDir: string; log: Logger }): Promise<void>;
  isKey(candidate: string): Promise<boolean>;
  /** Whether an active key is the operator's: KILN_API_KEY, or the key first start wrote to the data dir (seed). */
  isOperator(id: string | undefined): Promise<boolean>;
  /** Moves whenever this server makes a key: a list of keys read before it may lack that key. */
  createdGeneration(): number;
}

export function createKeyService(db: Db): KeyService {
  // Verified hashes are remembered so the hot path does not hit the store on every request. Revocation reaches them
  // through `revoked` (every revoked key id, reloaded whenever the store's count of revoked keys changes), which the
  // revocation poll keeps current; when the poll is not current, nothing remembered is trusted.
  const verified = new Map<string, { id: string; until: number }>();
  const lastUsedWritten = new Map<string, number>();
  const revoked = new Set<string>();
  const revokedListeners = new Set<(ids: string[]) => void>();
  let revokedCount = -1;
  let pollOkAt = 0;
  let created = 0;

  function announce(ids: string[]) {
    const fresh = ids.filter((id) => !revoked.has(id));
    for (const id of fresh) revoked.add(id);
    if (fresh.length === 0) return;
    for (const [hash, v] of verified) if (revoked.has(v.id)) verified.delete(hash);
    for (const fn of revokedListeners) fn(fresh);
  }

  /** One poll: a count of revoked keys (cheap, and it only grows: keys are never un-revoked or deleted), then their ids when it moved. */
  async function pollRevocations(): Promise<void> {
    const row = await db.selectFrom("api_keys").select((eb) => eb.fn.countAll().as("n")).where("revoked_at", "is not", null).executeTakeFirst();
    const count = Number(row?.n ?? 0);
    if (count !== revokedCount) {
      const rows = await db.selectFrom("api_keys").select("id").where("revoked_at", "is not", null).execute();
      announce(rows.map((r) => r.id));
      revokedCount = count;
    }
    pollOkAt = Date.now();
  }

  /**
   * Polls the store for revocations every REVOCATION_POLL_MS (one first poll before it resolves), so a key revoked by
   * another process or server stops working here, and its sockets close, within about a second. Returns the stop.
   */
  async function watchRevocations(onError: (err: unknown) => void): Promise<() => void> {
    await pollRevocations();
    let running = false;
    const timer = setInterval(() => {
      if (running) return;
      running = true;
      pollRevocations().then(
        () => (running = false),
        (err: unknown) => {
          running = false;
          onError(err);
        },
      );
    }, REVOCATION_POLL_MS);
    timer.unref();
    return () => clearInterval(timer);
  }

  /** Calls `fn` with the ids of keys revoked since (here or anywhere on the store, as the poll finds them). */
  function onRevoked(fn: (ids: string[]) => void): () => void {
    revokedListeners.add(fn);
    return () => revokedListeners.delete(fn);
  }

  /** Whether a key id (one this server issued a credential for) is still active. */
  async function isActive(id: string): Promise<boolean> {
    if (revoked.has(id)) return false;
    if (Date.now() - pollOkAt < POLL_STALE_MS) return true;
    const row = await db.selectFrom("api_keys").select("revoked_at").where("id", "=", id).executeTakeFirst();
    return row !== undefined && row.revoked_at === null;
  }

  /** Whether the key id is known to be revoked (synchronous: what the last poll or a local revoke said). */
  function isRevoked(id: string): boolean {
    return revoked.has(id);
  }

  async function create(name: string, key: string = generateKey()): Promise<KeySummary & { key: string }> {
    const row = {
      id: newId("key"),
      name,
      prefix: key.slice(0, 9),
      hash: hashKey(key),
      created_at: new Date().toISOString(),
      last_used_at: null,
      revoked_at: null,
    };
    await db.insertInto("api_keys").values(row).execute();
    created++;
    const { hash: _hash, ...summary } = row;
    return { ...summary, key };
  }

  async function list(): Promise<KeySummary[]> {
    return db
      .selectFrom("api_keys")
      .select(["id", "name", "prefix", "created_at", "last_used_at", "revoked_at"])
      .orderBy("id", "asc")
      .execute();
  }

  async function revoke(id: string): Promise<KeySummary> {
    const now = new Date().toISOString();
    const res = await db.updateTable("api_keys").set({ revoked_at: now }).where("id", "=", id).where("revoked_at", "is", null).executeTakeFirst();
    const row = await db.selectFrom("api_keys").select(["id", "name", "prefix", "created_at", "last_used_at", "revoked_at"]).where("id", "=", id).executeTakeFirst();
    if (!row) throw new KilnError("not_found", `No API key ${id}`);
    if (Number(res.numUpdatedRows) === 0 && row.revoked_at === null) throw new KilnError("conflict", `API key ${id} could not be revoked`);
    announce([id]);
    return row;
  }

  /**
   * The key's id when the presented key is active, null otherwise. A remembered answer costs a hash and two lookups;
   * it is used only while the revocation poll is current, so a revoked key is refused within about a second.
   */
  function verify(presented: string): string | null | Promise<string | null> {
    const now = Date.now();
    const hash = hashKey(presented);
    const hit = verified.get(hash);
    if (hit && hit.until > now && now - pollOkAt < POLL_STALE_MS && !revoked.has(hit.id)) return hit.id;
    return verifyInStore(hash, now);
  }

  async function verifyInStore(hash: string, now: number): Promise<string | null> {
    const row = await db.selectFrom("api_keys").select(["id", "hash"]).where("hash", "=", hash).where("revoked_at", "is", null).executeTakeFirst();
    if (!row || !timingSafeEqual(Buffer.from(row.hash, "hex"), Buffer.from(hash, "hex"))) {
      verified.delete(hash);
      return null;
    }
    if ((lastUsedWritten.get(row.id) ?? 0) < now - 60_000) {
      lastUsedWritten.set(row.id, now);
      await db.updateTable("api_keys").set({ last_used_at: new Date(now).toISOString() }).where("id", "=", row.id).execute();
    }
    // A revocation seen while this lookup was in flight wins over the row read before it.
    if (revoked.has(row.id)) return null;
    verified.set(hash, { id: row.id, until: now + VERIFIED_TTL_MS });
    return row.id;
  }

  /**
   * Makes sure the server can be reached: KILN_API_KEY is stored (hashed) when given; with no active key at all,
   * a new one is written to <dataDir>/api-key (0600) and only that path is logged.
   */
  async function seed(opts: { apiKey?: string; dataDir: string; log: Logger }): Promise<void> {
    await seedKeys(opts);
    // The operator's keys are the ones only the host's operator holds: the configured one, and the first-start file's.
    operatorHashes.clear();
    if (opts.apiKey) operatorHashes.add(hashKey(opts.apiKey));
    const written = await readFile(join(opts.dataDir, "api-key"), "utf8").catch(() => "");
    if (written.trim()) operatorHashes.add(hashKey(written.trim()));
  }

  const operatorHashes = new Set<string>();
  async function isOperator(id: string | undefined): Promise<boolean> {
    if (id === undefined || operatorHashes.size === 0) return false;
    const row = await db.selectFrom("api_keys").select("hash").where("id", "=", id).where("revoked_at", "is", null).executeTakeFirst();
    return row !== undefined && operatorHashes.has(row.hash);
  }

  async function seedKeys(opts: { apiKey?: string; dataDir: string; log: Logger }): Promise<void> {
    if (opts.apiKey) {
      const exists = await db.selectFrom("api_keys").select("id").where("hash", "=", hashKey(opts.apiKey)).executeTakeFirst();
      if (!exists) await create("KILN_API_KEY", opts.apiKey);
      return;
    }
    const active = await db.selectFrom("api_keys").select("id").where("revoked_at", "is", null).limit(1).executeTakeFirst();
    if (active) return;
    const made = await create("first-start");
    await mkdir(opts.dataDir, { recursive: true });
    const file = join(opts.dataDir, "api-key");
    await writeFile(file, made.key + "\n", { mode: 0o600 });
    await chmod(file, 0o600);
    opts.log.info({ file, key_id: made.id }, "no API key was configured: wrote a new one to the file");
  }

  /**
   * Whether a string is a key of this Kiln, revoked or not: in a format Kiln issues, or hashing to a stored key (an
   * operator's KILN_API_KEY can be any string). The proxies use it to keep keys away from services.
   */
  async function isKey(candidate: string): Promise<boolean> {
    if (ISSUED_KEY.test(candidate)) return true;
    const hash = hashKey(candidate);
    if (verified.has(hash)) return true;
    return (await db.selectFrom("api_keys").select("id").where("hash", "=", hash).executeTakeFirst()) !== undefined;
  }

  return { create, list, revoke, verify, isActive, isRevoked, onRevoked, watchRevocations, seed, isKey, isOperator, createdGeneration: () => created };
}
