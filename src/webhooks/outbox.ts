// The webhook outbox: a lifecycle event and one delivery row per matching enabled webhook, written in the caller's
// transaction, so an event is never recorded without its deliveries (nor a delivery without its event).

import type { Insertable } from "kysely";
import type { Db, WebhookDeliveriesTable } from "../store/schema.ts";
import { newId } from "../store/ids.ts";

/** One event as receivers get it: `payload` is the JSON body, the same on every attempt. */
export interface OutboxEvent {
  id: string; // evt_…
  operation: string;
  occurredAt: string;
  payload: unknown;
}

/** A new delivery row of one event to one webhook, queued to go at once (a first send, or a replay of an earlier one). */
export function queuedDelivery(d: { webhookId: string; eventId: string; operation: string; body: string; now: string; id?: string }): Insertable<WebhookDeliveriesTable> {
  return {
    id: d.id ?? newId("dlv"),
    webhook_id: d.webhookId,
    event_id: d.eventId,
    operation: d.operation,
    body: d.body,
    status: "queued",
    attempts: 0,
    schedule_base: 0,
    next_attempt_at: d.now,
    claimed_by: null,
    claimed_at: null,
    claim_expires_at: null,
    last_status_code: null,
    last_error: null,
    created_at: d.now,
    updated_at: d.now,
    completed_at: null,
  };
}

/** Writes a delivery for each enabled webhook subscribed to the event's operation; returns how many. */
export async function enqueueDeliveries(tx: Db, event: OutboxEvent): Promise<number> {
  const hooks = await tx.selectFrom("webhooks").select(["id", "operations_json"]).where("enabled", "=", 1).execute();
  const matching = hooks.filter((h) => (JSON.parse(h.operations_json) as string[]).includes(event.operation));
  if (matching.length === 0) return 0;
  const body = JSON.stringify(event.payload);
  const now = new Date().toISOString();
  await tx
    .insertInto("webhook_deliveries")
    .values(
      matching.map((h) => queuedDelivery({ webhookId: h.id, eventId: event.id, operation: event.operation, body, now })),
    )
    .execute();
  return matching.length;
}

/** Records a machine's lifecycle event (the `events` row) and its deliveries in the caller's transaction. */
export async function recordEvent(tx: Db, event: OutboxEvent & { machineId: string }): Promise<number> {
  await tx
    .insertInto("events")
    .values({ id: event.id, operation: event.operation, machine_id: event.machineId, payload_json: JSON.stringify(event.payload), occurred_at: event.occurredAt })
    .execute();
  return enqueueDeliveries(tx, event);
}

// Dispatchers of this process wait on these instead of polling; keyed by store so test servers sharing a process
// only wake their own.
const listeners = new WeakMap<Db, Set<() => void>>();

/** Call after the transaction that queued deliveries has committed: wakes this process's dispatcher at once. */
export function announceDeliveries(db: Db): void {
  for (const fn of listeners.get(db) ?? []) fn();
}

export function onDeliveriesQueued(db: Db, fn: () => void): () => void {
  let set = listeners.get(db);
  if (!set) listeners.set(db, (set = new Set()));
  set.add(fn);
  return () => set.delete(fn);
}
