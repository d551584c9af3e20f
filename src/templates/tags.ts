// A template's tags: which artifact each of its tags points at. A build moves its tags onto its artifact; E2B's
// assignTags/removeTags move and drop them by hand. Either way an artifact left with no tag starts its retention
// clock (src/builder/retention.ts collects it later), and one a tag points at again stops it.

import type { Transaction } from "kysely";
import type { Database, Db } from "../store/schema.ts";

type Tx = Transaction<Database>;

/** Starts the retention clock of the artifacts among `ids` no tag points at any more. */
async function expireUntagged(tx: Tx, ids: Iterable<string>, retentionS: number) {
  const expires = new Date(Date.now() + retentionS * 1000).toISOString();
  for (const id of new Set(ids)) {
    const still = await tx.selectFrom("artifact_tags").select("tag").where("artifact_id", "=", id).executeTakeFirst();
    if (!still) await tx.updateTable("artifacts").set({ retention_expires_at: expires }).where("id", "=", id).where("retention_expires_at", "is", null).execute();
  }
}

/** Points `tags` of a template at one of its artifacts (adding the ones it lacks), in one transaction. */
export async function pointTags(db: Db, o: { templateId: string; tags: string[]; artifactId: string; retentionS: number }): Promise<void> {
  const now = new Date().toISOString();
  await db.transaction().execute(async (tx) => {
    const before = await tx.selectFrom("artifact_tags").select(["tag", "artifact_id"]).where("template_id", "=", o.templateId).execute();
    for (const tag of o.tags) {
      if (before.some((b) => b.tag === tag)) await tx.updateTable("artifact_tags").set({ artifact_id: o.artifactId, updated_at: now }).where("template_id", "=", o.templateId).where("tag", "=", tag).execute();
      else await tx.insertInto("artifact_tags").values({ template_id: o.templateId, tag, artifact_id: o.artifactId, updated_at: now }).execute();
    }
    await tx.updateTable("artifacts").set({ retention_expires_at: null }).where("id", "=", o.artifactId).execute();
    await expireUntagged(tx, before.map((b) => b.artifact_id).filter((id) => id !== o.artifactId), o.retentionS);
    await tx.updateTable("templates").set({ updated_at: now }).where("id", "=", o.templateId).execute();
  });
}

/** Removes `tags` from a template (ones it lacks are ignored); the tags it removed. */
export async function dropTags(db: Db, o: { templateId: string; tags: string[]; retentionS: number }): Promise<string[]> {
  if (o.tags.length === 0) return [];
  return db.transaction().execute(async (tx) => {
    const gone = await tx.selectFrom("artifact_tags").select(["tag", "artifact_id"]).where("template_id", "=", o.templateId).where("tag", "in", o.tags).execute();
    if (gone.length === 0) return [];
    await tx.deleteFrom("artifact_tags").where("template_id", "=", o.templateId).where("tag", "in", o.tags).execute();
    await expireUntagged(tx, gone.map((g) => g.artifact_id), o.retentionS);
    await tx.updateTable("templates").set({ updated_at: new Date().toISOString() }).where("id", "=", o.templateId).execute();
    return gone.map((g) => g.tag);
  });
}
