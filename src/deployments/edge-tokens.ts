// Signed, expiring edge tokens for services' public URLs: HMAC-SHA256 over {service id, expiry} with the edge
// secret, one per store (every server of a cluster checks the URLs another issued), seeded from the first server's
// data dir. The token is checked by recomputing it, so no token is ever stored.

import { createHmac, createSecretKey, timingSafeEqual } from "node:crypto";
import type { KeyObject } from "node:crypto";
import { loadKeyFile } from "./key-files.ts";
import type { Db } from "../store/schema.ts";

export const EDGE_SECRET_FILE = "edge-secret";

/** The store's edge secret in `cluster_secrets`, shared by every server of the store. */
const SECRET_NAME = "edge";

/**
 * The edge secret every server of the store uses: the first server to need it writes its data dir's (so the URLs a
 * server alone on its store issued before keep working), every other reads that one. A server that joins a store
 * whose secret another wrote keeps its own file unused: URLs it issued alone before stop working.
 */
export async function loadStoreEdgeSecret(db: Db, dataDir: string): Promise<KeyObject> {
  const existing = await db.selectFrom("cluster_secrets").select("secret").where("name", "=", SECRET_NAME).executeTakeFirst();
  if (!existing) {
    const seed = await loadKeyFile(dataDir, EDGE_SECRET_FILE);
    await db
      .insertInto("cluster_secrets")
      .values({ name: SECRET_NAME, secret: seed.toString("base64url"), created_at: new Date().toISOString() })
      .onConflict((oc) => oc.column("name").doNothing())
      .execute();
  }
  const row = existing ?? (await db.selectFrom("cluster_secrets").select("secret").where("name", "=", SECRET_NAME).executeTakeFirstOrThrow());
  return createSecretKey(Buffer.from(row.secret, "base64url"));
}

/** The edge secret of this data dir (made on first start; deleting it invalidates every URL). A KeyObject, because
 *  turning raw bytes into a key on every HMAC costs more than the HMAC itself. */
export async function loadEdgeSecret(dataDir: string): Promise<KeyObject> {
  return createSecretKey(await loadKeyFile(dataDir, EDGE_SECRET_FILE));
}

/**
 * The signature also covers the deployment's salt (when it has one: deployments made before issue 24 have none until
 * their first rotation), so rotating the deployment's token stops the signed URLs already handed out too.
 */
function mac(secret: KeyObject, serviceId: string, expiresAtS: number, salt: string): string {
  return createHmac("sha256", secret).update(`kiln-edge-v1\n${serviceId}\n${expiresAtS}${salt ? `\n${salt}` : ""}`).digest("base64url");
}

/** `<expiry in unix seconds, base 36>.<signature>`: URL-safe, bound to one service and its deployment's salt. */
export function signEdgeToken(secret: KeyObject, serviceId: string, expiresAtMs: number, salt = ""): string {
  const exp = Math.floor(expiresAtMs / 1000);
  return `${exp.toString(36)}.${mac(secret, serviceId, exp, salt)}`;
}

export type EdgeTokenCheck = { ok: true; expiresAtMs: number } | { ok: false; reason: "malformed" | "bad_signature" | "expired" };

export function verifyEdgeToken(secret: KeyObject, serviceId: string, token: string, nowMs = Date.now(), salt = ""): EdgeTokenCheck {
  const m = /^([0-9a-z]{1,12})\.([A-Za-z0-9_-]{43})$/.exec(token);
  if (!m) return { ok: false, reason: "malformed" };
  const exp = parseInt(m[1], 36);
  const want = Buffer.from(mac(secret, serviceId, exp, salt));
  const got = Buffer.from(m[2]);
  if (want.length !== got.length || !timingSafeEqual(want, got)) return { ok: false, reason: "bad_signature" };
  if (exp * 1000 <= nowMs) return { ok: false, reason: "expired" };
  return { ok: true, expiresAtMs: exp * 1000 };
}

/**
 * The long-lived token of a deployment in `token` access: `kse_<base64url HMAC-SHA256 over {deployment id, salt}>`
 * under the same edge secret. Nothing secret is stored: the store keeps the salt, which is useless without the
 * secret file; rotating draws a new salt, so the old token stops matching at once.
 */
export function stableEdgeToken(secret: KeyObject, deploymentId: string, salt: string): string {
  return `kse_${createHmac("sha256", secret).update(`kiln-edge-stable-v1\n${deploymentId}\n${salt}`).digest("base64url")}`;
}

/** Constant-time comparison of a presented token with the expected one (both ASCII). */
export function sameToken(expected: Buffer, presented: string): boolean {
  const got = Buffer.from(presented);
  return got.length === expected.length && timingSafeEqual(got, expected);
}
