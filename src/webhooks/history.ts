// How long the outbox remembers: finished deliveries (succeeded or dead-lettered), their attempts and the events
// they came from are removed once older than the history period, in small batches, so the store stays bounded on a
// server that sends webhooks for months. Queued and in-flight deliveries are never touched.

import type { Db } from "../store/schema.ts";

/** Rows removed per transaction: a long backlog is pruned without holding a write lock for long. */
const BATCH = 500;

export async function pruneWebhookHistory(db: Db, olderThan: Date): Promise<{ deliveries: number; events: number }> {
  const cutoff = olderThan.toISOString();
  let deliveries = 0;
  for (;;) {
    const ids = (
      await db.selectFrom("webhook_deliveries").select("id").where("status", "in", ["succeeded", "dead_letter"]).where("completed_at", "<", cutoff).limit(BATCH).execute()
    ).map((r) => r.id);
    if (ids.length === 0) break;
    await db.transaction().execute(async (tx) => {
      await tx.deleteFrom("webhook_delivery_attempts").where("delivery_id", "in", ids).execute();
      // Re-checked in the delete: a manual retry may have queued one again since it was read.
      const gone = await tx.deleteFrom("webhook_deliveries").where("id", "in", ids).where("status", "in", ["succeeded", "dead_letter"]).executeTakeFirst();
      deliveries += Number(gone.numDeletedRows);
    });
    if (ids.length < BATCH) break;
  }
  let events = 0;
  for (;;) {
    // An event is kept while any delivery of it is (a queued one still sends the body it holds, a finished one may
    // still be replayed).
    const ids = (
      await db
        .selectFrom("events")
        .select("id")
        .where("occurred_at", "<", cutoff)
        .where(({ not, exists, selectFrom }) => not(exists(selectFrom("webhook_deliveries").select("webhook_deliveries.id").whereRef("webhook_deliveries.event_id", "=", "events.id"))))
        .limit(BATCH)
        .execute()
    ).map((r) => r.id);
    if (ids.length === 0) break;
    const gone = await db.deleteFrom("events").where("id", "in", ids).executeTakeFirst();
    events += Number(gone.numDeletedRows);
    if (ids.length < BATCH) break;
  }
  return { deliveries, events };
}
