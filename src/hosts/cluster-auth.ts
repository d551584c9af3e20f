// Host-to-host authentication: a request one server forwards to another carries an HMAC, keyed by the cluster secret
// in the store, over the method, the path with its query, the time, a random nonce, the caller's key id and both
// hosts' ids (the nonce: two identical requests forwarded in the same millisecond are two signatures, not a replay). A peer
// accepts it only within a short window, only addressed to itself, and only once (a replayed signature is refused).

import { createHmac, randomBytes, timingSafeEqual } from "node:crypto";
import type { IncomingHttpHeaders } from "node:http";
import { KilnError } from "../errors.ts";

export const CLUSTER_HEADERS = {
  from: "x-kiln-cluster-from",
  to: "x-kiln-cluster-to",
  ts: "x-kiln-cluster-ts",
  key: "x-kiln-cluster-key",
  nonce: "x-kiln-cluster-nonce",
  sig: "x-kiln-cluster-sig",
} as const;
const NAMES = Object.values(CLUSTER_HEADERS);

/** A forwarded request older (or newer: clock skew) than this is refused. */
export const CLUSTER_AUTH_WINDOW_MS = 30_000;
/** Signatures remembered to refuse replays (within the window); past this many, the oldest are forgotten early. */
const SEEN_MAX = 200_000;

export interface Forwarded {
  from: string;
  /** The API key id the first server authenticated (empty: the route needs no key). */
  keyId: string | undefined;
}

export function hasClusterHeaders(headers: IncomingHttpHeaders): boolean {
  for (const name of NAMES) if (headers[name] !== undefined) return true;
  return false;
}

function mac(secret: Buffer, parts: string[]): string {
  const h = createHmac("sha256", secret);
  for (const p of parts) h.update(`${p.length}:${p}\n`);
  return h.digest("base64url");
}

export function createClusterAuth(opts: { secret: Buffer; hostId: string; now?: () => number }) {
  const { secret, hostId } = opts;
  const now = opts.now ?? Date.now;
  const seen = new Map<string, number>();
  /**
   * Signatures dated before this are refused: this server cannot know whether they were used. It starts at the
   * server's start (the used ones are remembered in memory only, so a request captured before a restart would
   * otherwise be good again for the rest of its window) and rises past any signature forgotten early (the cap).
   */
  let floor = now();

  /** Headers for a request this server forwards to host `to` for key `keyId`. */
  function sign(method: string, path: string, to: string, keyId: string | undefined): Record<string, string> {
    const ts = String(now());
    const key = keyId ?? "";
    const nonce = randomBytes(12).toString("base64url");
    return {
      [CLUSTER_HEADERS.from]: hostId,
      [CLUSTER_HEADERS.to]: to,
      [CLUSTER_HEADERS.ts]: ts,
      [CLUSTER_HEADERS.key]: key,
      [CLUSTER_HEADERS.nonce]: nonce,
      [CLUSTER_HEADERS.sig]: mac(secret, [method.toUpperCase(), path, ts, nonce, key, hostId, to]),
    };
  }

  function refuse(why: string): never {
    throw new KilnError("unauthorized", `Cluster authentication failed: ${why}`, { detail: { code: "unauthorized", phase: "cluster-auth" } });
  }

  /** Checks a forwarded request's headers: who sent it and for which key, or a 401 (never a fallback to other credentials). */
  function verify(method: string, path: string, headers: IncomingHttpHeaders): Forwarded {
    const get = (name: string) => {
      const v = headers[name];
      return typeof v === "string" && v.length <= 512 ? v : undefined;
    };
    const from = get(CLUSTER_HEADERS.from);
    const to = get(CLUSTER_HEADERS.to);
    const ts = get(CLUSTER_HEADERS.ts);
    const key = get(CLUSTER_HEADERS.key);
    const sig = get(CLUSTER_HEADERS.sig);
    const nonce = get(CLUSTER_HEADERS.nonce);
    if (!from || !to || !ts || key === undefined || !sig || !nonce || nonce.length > 64) refuse("incomplete cluster headers");
    if (to !== hostId) refuse("the request is addressed to another host");
    const t = Number(ts);
    if (!/^\d{1,16}$/.test(ts) || Math.abs(now() - t) > CLUSTER_AUTH_WINDOW_MS) refuse("the signature is outside its validity window");
    if (t < floor) refuse("the signature predates what this server remembers of used signatures (it restarted since)");
    const expected = Buffer.from(mac(secret, [method.toUpperCase(), path, ts, nonce, key, from, to]));
    const given = Buffer.from(sig);
    if (given.length !== expected.length || !timingSafeEqual(given, expected)) refuse("bad signature");
    if (seen.has(sig)) refuse("the signature was already used");
    remember(sig, t + CLUSTER_AUTH_WINDOW_MS);
    return { from, keyId: key || undefined };
  }

  function remember(sig: string, until: number) {
    const t = now();
    // Oldest first (insertion order): expired ones go, and past the cap the oldest too.
    for (const [s, exp] of seen) {
      if (exp >= t && seen.size < SEEN_MAX) break;
      // Forgotten while still within its window: nothing as old may be accepted any more.
      if (exp >= t) floor = Math.max(floor, exp - CLUSTER_AUTH_WINDOW_MS + 1);
      seen.delete(s);
    }
    seen.set(sig, until);
  }

  return { sign, verify };
}

export type ClusterAuth = ReturnType<typeof createClusterAuth>;
