// Secrets every server of one store shares (the forwarding secret, the E2B tokens' secret): one row per name in
// `cluster_secrets`, made by the first server that needs it. Concurrent first servers race on the insert; the row
// that won is what all of them read back, so no two servers ever hold different secrets of one name.

import { randomBytes } from "node:crypto";
import type { Db } from "./schema.ts";

/** The secret named `name`; when the store has none yet, `initial` (or 32 random bytes) becomes it. */
export async function storedSecret(db: Db, name: string, initial?: () => Promise<Buffer | undefined>): Promise<Buffer> {
  const existing = await db.selectFrom("cluster_secrets").select("secret").where("name", "=", name).executeTakeFirst();
  if (existing) return Buffer.from(existing.secret, "base64url");
  const made = (await initial?.()) ?? randomBytes(32);
  await db
    .insertInto("cluster_secrets")
    .values({ name, secret: made.toString("base64url"), created_at: new Date().toISOString() })
    .onConflict((oc) => oc.column("name").doNothing())
    .execute();
  const row = await db.selectFrom("cluster_secrets").select("secret").where("name", "=", name).executeTakeFirstOrThrow();
  return Buffer.from(row.secret, "base64url");
}
