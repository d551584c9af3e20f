// Kiln's own credentials never cross a proxy into a service (the edge and the E2B port proxy): which request headers
// may carry them, and how a value is recognised as one. A service's own credentials pass untouched.

import { createHash } from "node:crypto";
import type { OutgoingHttpHeaders } from "node:http";

/**
 * Headers that exist only to carry Kiln's (and its E2B layer's) credentials to Kiln: envd access tokens and E2B's
 * traffic token. Never forwarded, whatever they hold.
 */
export const KILN_ONLY_HEADERS = ["x-access-token", "e2b-traffic-access-token"] as const;

/**
 * Headers that carry Kiln's API keys (`Authorization: Bearer`, E2B's `X-API-Key`) but that services use for their
 * own credentials too: forwarded unless a credential in them is Kiln's, in any scheme (a Basic user or password too).
 */
export const SHARED_HEADERS = ["authorization", "x-api-key"] as const;

/**
 * A WebSocket subprotocol that carries a Kiln API key (browsers cannot set Authorization on an upgrade; the console
 * offers `kiln.bearer.<base64url key>`). Removed from `Sec-WebSocket-Protocol` before a handshake reaches a service.
 */
export const KILN_BEARER_SUBPROTOCOL = "kiln.bearer.";

/** Whether a string is one of Kiln's credentials (an API key, revoked or not; a sandbox's access token). */
export type IsKilnCredential = (candidate: string) => boolean | Promise<boolean>;

/** The strings a credential header value carries: the value, its scheme's parameter, Basic's user and password. */
export function credentialCandidates(value: string): string[] {
  const out = new Set<string>();
  const v = value.trim();
  if (v) out.add(v);
  const m = /^([A-Za-z][A-Za-z0-9!#$%&'*+.^_`|~-]*)\s+(.+)$/.exec(v);
  if (m) {
    const param = m[2].trim();
    out.add(param);
    if (m[1].toLowerCase() === "basic") {
      const decoded = Buffer.from(param, "base64").toString("utf8");
      const colon = decoded.indexOf(":");
      for (const part of colon < 0 ? [decoded] : [decoded.slice(0, colon), decoded.slice(colon + 1)]) if (part) out.add(part);
    }
  }
  return [...out];
}

/** Whether any header that may carry a Kiln credential is present (most requests have none: no lookup at all). */
export function mayCarryKilnCredentials(headers: OutgoingHttpHeaders): boolean {
  for (const name of KILN_ONLY_HEADERS) if (headers[name] !== undefined) return true;
  for (const name of SHARED_HEADERS) if (headers[name] !== undefined) return true;
  return String(headers["sec-websocket-protocol"] ?? "").includes(KILN_BEARER_SUBPROTOCOL);
}

/**
 * Removes Kiln's credentials from request headers bound for a service (in place): the Kiln-only headers always,
 * a shared one when anything it carries is Kiln's. Answers the names removed (for tests and logs; never values).
 */
export async function stripKilnCredentials(headers: OutgoingHttpHeaders, isKiln: IsKilnCredential): Promise<string[]> {
  const removed: string[] = [];
  for (const name of KILN_ONLY_HEADERS) {
    if (headers[name] === undefined) continue;
    delete headers[name];
    removed.push(name);
  }
  for (const name of SHARED_HEADERS) {
    const value = headers[name];
    if (value === undefined) continue;
    const values = Array.isArray(value) ? value : [String(value)];
    let kiln = false;
    for (const v of values) {
      for (const c of credentialCandidates(v)) {
        if (await isKiln(c)) {
          kiln = true;
          break;
        }
      }
      if (kiln) break;
    }
    if (kiln) {
      delete headers[name];
      removed.push(name);
    }
  }
  const protocols = headers["sec-websocket-protocol"];
  if (protocols !== undefined && String(protocols).includes(KILN_BEARER_SUBPROTOCOL)) {
    const kept = String(protocols).split(",").map((p) => p.trim()).filter((p) => p && !p.startsWith(KILN_BEARER_SUBPROTOCOL));
    if (kept.length > 0) headers["sec-websocket-protocol"] = kept.join(", ");
    else delete headers["sec-websocket-protocol"];
    removed.push("sec-websocket-protocol");
  }
  return removed;
}

/**
 * Remembers recent answers of a slower check (a store lookup) so a service whose clients send their own bearer
 * token on every request costs one lookup per token, not per request. Bounded: cleared when full.
 */
export function rememberedCheck(check: (candidate: string) => Promise<boolean>, max = 4096, ttlMs = 60_000): (candidate: string) => Promise<boolean> {
  const seen = new Map<string, { is: boolean; until: number }>();
  return async (candidate) => {
    // Held by digest: the cache never keeps a credential itself.
    const key = createHash("sha256").update(candidate).digest("base64");
    const hit = seen.get(key);
    if (hit && hit.until > Date.now()) return hit.is;
    const is = await check(candidate);
    if (seen.size >= max) seen.clear();
    seen.set(key, { is, until: Date.now() + ttlMs });
    return is;
  };
}
