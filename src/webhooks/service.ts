// Lifecycle webhooks for the API: registrations (write-only signing secrets, rotation with a grace period) and
// the inspection, manual retry and replay of their deliveries. Sending is the dispatcher's (src/webhooks/dispatcher.ts).

import type { Db, DeliveryAttemptRow, DeliveryRow, WebhookRow } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import { LIFECYCLE_OPERATIONS } from "../machines/service.ts";
import { SERVICE_EVENT_OPERATIONS } from "../deployments/lifecycle.ts";
import type { LifecycleOperation } from "../machines/service.ts";
import { generateSecret, secretProblem } from "./signing.ts";
import { addressProblem, ipLiteral } from "./ssrf.ts";
import type { Resolve } from "./ssrf.ts";
import { lookup as dnsLookup } from "node:dns";
import type { DeliveryStatus } from "./dispatcher.ts";
import { newestFirstPage } from "../store/pages.ts";
import { queuedDelivery } from "./outbox.ts";

export { DELIVERY_STATUSES } from "./dispatcher.ts";

/** What a webhook may subscribe to: one list, shared with what emits them — the machine lifecycle and the status
 *  changes of deployment services (`service.ready`, …). */
export const WEBHOOK_OPERATIONS = [...LIFECYCLE_OPERATIONS, ...Object.values(SERVICE_EVENT_OPERATIONS)] as const;
export type WebhookOperation = (typeof WEBHOOK_OPERATIONS)[number];

export interface CreateWebhookInput {
  url: string;
  operations: WebhookOperation[];
  signing_secret?: string;
  allow_private?: boolean;
}

export interface UpdateWebhookInput {
  url?: string;
  operations?: WebhookOperation[];
  signing_secret?: string;
  enabled?: boolean;
  allow_private?: boolean;
}

/** Who asks: only the operator's key may let a webhook reach private addresses (docs/webhooks.md). */
export interface Caller {
  operator: boolean;
}

/** The webhook record as the API shows it: never any secret. */
export function webhookView(row: WebhookRow) {
  return {
    id: row.id,
    url: row.url,
    operations: JSON.parse(row.operations_json) as LifecycleOperation[],
    enabled: row.enabled === 1,
    allow_private: row.allow_private === 1,
    created_at: row.created_at,
    updated_at: row.updated_at,
  };
}
export type WebhookView = ReturnType<typeof webhookView>;

export function deliveryView(row: DeliveryRow, attempts: DeliveryAttemptRow[]) {
  return {
    id: row.id,
    webhook_id: row.webhook_id,
    event_id: row.event_id,
    operation: row.operation,
    status: row.status as DeliveryStatus,
    attempts: attempts.map((a) => ({
      attempt: a.attempt,
      started_at: a.started_at,
      duration_ms: a.duration_ms,
      status_code: a.status_code,
      error: a.error,
      response_excerpt: a.response_excerpt,
    })),
    next_attempt_at: row.status === "queued" ? row.next_attempt_at : null,
    last_status_code: row.last_status_code,
    last_error: row.last_error,
    created_at: row.created_at,
    updated_at: row.updated_at,
    completed_at: row.completed_at,
  };
}
export type DeliveryView = ReturnType<typeof deliveryView>;

type Page<T> = { items: T[]; last?: [string, string]; more: boolean };

/** A create or update waits at most this long on DNS to judge a receiver's name; past it the name is taken as is. */
const NAME_CHECK_TIMEOUT_MS = 3_000;

export interface WebhookService {
  create(input: CreateWebhookInput, caller?: Caller): Promise<WebhookView & { signing_secret?: string }>;
  get(id: string): Promise<WebhookView>;
  list(opts: { limit: number; after?: [string, string] }): Promise<Page<WebhookView>>;
  update(id: string, input: UpdateWebhookInput, caller?: Caller): Promise<WebhookView>;
  remove(id: string): Promise<{ id: string; deleted: true }>;
  listDeliveries(webhookId: string, opts: { limit: number; after?: [string, string]; status?: DeliveryStatus }): Promise<Page<DeliveryView>>;
  getDelivery(webhookId: string, deliveryId: string): Promise<DeliveryView & { payload: unknown }>;
  retryDelivery(webhookId: string, deliveryId: string): Promise<DeliveryView>;
  replayDelivery(webhookId: string, deliveryId: string): Promise<DeliveryView>;
}

/**
 * Deliveries of one webhook that may wait to be sent at once (queued or being sent): a replay past it is refused, so
 * a key holder replaying in a loop cannot grow the outbox without bound while the receiver is slow or away.
 */
export const MAX_PENDING_DELIVERIES_PER_WEBHOOK = 1000;

export function createWebhookService(deps: { db: Db; allowPrivate: boolean; rotationGraceMs: number; wake: () => void; resolve?: Resolve }): WebhookService {
  const { db } = deps;

  /**
   * http(s) only, no credentials in it, and judged as a delivery judges it: an IP literal, and every address a name
   * resolves to now (`localhost` is 127.0.0.1), must be one a delivery may reach. A name that does not resolve yet
   * is accepted: its deliveries fail and retry until it does, as they would for a receiver that goes away later.
   */
  async function checkUrl(raw: string, hookAllowsPrivate: boolean): Promise<string> {
    const allowPrivate = deps.allowPrivate || hookAllowsPrivate;
    let url: URL;
    try {
      url = new URL(raw);
    } catch {
      throw new KilnError("invalid_request", `url is not a URL: ${JSON.stringify(raw.slice(0, 200))}`);
    }
    if (url.protocol !== "http:" && url.protocol !== "https:") throw new KilnError("invalid_request", `url must be http or https, not ${url.protocol.replace(/:$/, "")}`);
    if (url.username || url.password) throw new KilnError("invalid_request", "url must not carry credentials (user:password@); put a token in the path or query, or verify signatures");
    const literal = ipLiteral(url.hostname);
    const problem = literal ? addressProblem(literal, allowPrivate) : await nameProblem(url.hostname, allowPrivate);
    if (problem) throw new KilnError("invalid_request", `url is not allowed: ${problem}`);
    return url.toString();
  }

  /** What a delivery's guarded lookup would refuse about this name's addresses now, or null. */
  function nameProblem(hostname: string, allowPrivate: boolean): Promise<string | null> {
    const resolve = deps.resolve ?? (dnsLookup as unknown as Resolve);
    return new Promise((done) => {
      const timer = setTimeout(() => done(null), NAME_CHECK_TIMEOUT_MS);
      resolve(hostname, { all: true }, (err, addresses) => {
        clearTimeout(timer);
        if (err) return done(null);
        for (const a of addresses) {
          const problem = addressProblem(a.address, allowPrivate);
          if (problem) return done(`${hostname}: ${problem}`);
        }
        done(null);
      });
    });
  }

  function checkOperations(ops: string[]): string {
    const unknown = ops.filter((o) => !(WEBHOOK_OPERATIONS as readonly string[]).includes(o));
    if (unknown.length > 0) throw new KilnError("invalid_request", `Unknown operation ${JSON.stringify(unknown[0])}: one of ${WEBHOOK_OPERATIONS.join(", ")}`);
    if (ops.length === 0) throw new KilnError("invalid_request", "operations must name at least one operation");
    return JSON.stringify([...new Set(ops)]);
  }

  function checkSecret(secret: string): string {
    const problem = secretProblem(secret);
    if (problem) throw new KilnError("invalid_request", `signing_secret is not usable: ${problem}`);
    return secret;
  }

  async function load(id: string): Promise<WebhookRow> {
    const row = await db.selectFrom("webhooks").selectAll().where("id", "=", id).executeTakeFirst();
    if (!row) throw new KilnError("not_found", `No webhook ${id}`);
    return row;
  }

  /** The new record, and the signing secret when Kiln made it (shown in this one response only). */
  function checkOperator(caller: Caller | undefined, what: string): void {
    if (!caller?.operator) {
      throw new KilnError("forbidden", `${what} needs the operator's key (KILN_API_KEY, or the one first start wrote to the data dir): a webhook that reaches private addresses reaches the host's network`);
    }
  }

  async function create(input: CreateWebhookInput, caller?: Caller): Promise<WebhookView & { signing_secret?: string }> {
    if (input.allow_private) checkOperator(caller, "allow_private: true");
    const url = await checkUrl(input.url, input.allow_private === true);
    const operations = checkOperations(input.operations);
    const generated = input.signing_secret === undefined ? generateSecret() : undefined;
    const secret = generated ?? checkSecret(input.signing_secret!);
    const now = new Date().toISOString();
    const row: WebhookRow = {
      id: newId("whk"),
      url,
      operations_json: operations,
      enabled: 1,
      signing_secret: secret,
      previous_signing_secret: null,
      previous_secret_expires_at: null,
      allow_private: input.allow_private ? 1 : 0,
      created_at: now,
      updated_at: now,
    };
    await db.insertInto("webhooks").values(row).execute();
    return generated ? { ...webhookView(row), signing_secret: generated } : webhookView(row);
  }

  async function get(id: string): Promise<WebhookView> {
    return webhookView(await load(id));
  }

  async function list(opts: { limit: number; after?: [string, string] }): Promise<Page<WebhookView>> {
    const page = await newestFirstPage(db.selectFrom("webhooks").selectAll(), opts);
    return { items: page.rows.map(webhookView), last: page.last, more: page.more };
  }

  /**
   * A new signing_secret rotates: the old one keeps signing beside it for the grace period. Letting a webhook reach
   * private addresses (allow_private: true), or moving the url of one that may, takes the operator's key; turning it
   * off does not. When its receiver may now be reached (private allowed, or a new url), deliveries that were refused
   * for its address are due at once instead of at their next scheduled retry.
   */
  async function update(id: string, input: UpdateWebhookInput, caller?: Caller): Promise<WebhookView> {
    const set: Partial<WebhookRow> = {};
    const current = await load(id);
    if (input.allow_private === true) checkOperator(caller, "allow_private: true");
    const allowPrivate = input.allow_private ?? current.allow_private === 1;
    if (input.url !== undefined && current.allow_private === 1 && input.allow_private !== false) checkOperator(caller, "Changing the url of a webhook with allow_private");
    if (input.allow_private !== undefined) set.allow_private = input.allow_private ? 1 : 0;
    if (input.url !== undefined) set.url = await checkUrl(input.url, allowPrivate);
    else if (input.allow_private === false) await checkUrl(current.url, false).catch((err: unknown) => {
      throw err instanceof KilnError ? new KilnError("invalid_request", `allow_private: false would refuse this webhook's url; change the url too (${err.message})`) : err;
    });
    if (input.operations !== undefined) set.operations_json = checkOperations(input.operations);
    if (input.enabled !== undefined) set.enabled = input.enabled ? 1 : 0;
    const secret = input.signing_secret === undefined ? undefined : checkSecret(input.signing_secret);
    const now = new Date();
    const checked = current;
    // The checks above were made on `checked`: an update that raced another (the operator allowing private addresses
    // while a key holder moves the url) must not land on a record they were not made for.
    const changedMeanwhile = () => new KilnError("conflict", `Webhook ${id} changed while this update was checked; send it again`);
    const row = await db.transaction().execute(async (tx) => {
      const current = await tx.selectFrom("webhooks").selectAll().where("id", "=", id).executeTakeFirst();
      if (!current) throw new KilnError("not_found", `No webhook ${id}`);
      if (current.url !== checked.url || current.allow_private !== checked.allow_private) throw changedMeanwhile();
      if (secret !== undefined && secret !== current.signing_secret) {
        set.signing_secret = secret;
        set.previous_signing_secret = current.signing_secret;
        set.previous_secret_expires_at = new Date(now.getTime() + deps.rotationGraceMs).toISOString();
      }
      set.updated_at = now.toISOString();
      const updated = await tx.updateTable("webhooks").set(set).where("id", "=", id).where("url", "=", checked.url).where("allow_private", "=", checked.allow_private).executeTakeFirst();
      if (Number(updated.numUpdatedRows) !== 1) throw changedMeanwhile();
      if (set.url !== undefined || set.allow_private === 1) await refusedDueNow(tx, id, now.toISOString());
      return { ...current, ...set };
    });
    // Deliveries held back while it was disabled, or refused for an address it may now reach, are due now.
    if (input.enabled || set.url !== undefined || set.allow_private === 1) deps.wake();
    return webhookView(row);
  }

  /**
   * Deliveries whose last attempt was refused for the receiver's address go again now: queued ones without waiting
   * out their retry delay, dead letters for one more run of the schedule (as a manual retry would).
   */
  async function refusedDueNow(tx: Db, id: string, now: string): Promise<void> {
    await tx
      .updateTable("webhook_deliveries")
      .set({ next_attempt_at: now, updated_at: now })
      .where("webhook_id", "=", id)
      .where("status", "=", "queued")
      .where("last_error", "like", "refused:%")
      .execute();
    await tx
      .updateTable("webhook_deliveries")
      .set((eb) => ({ status: "queued", schedule_base: eb.ref("attempts"), next_attempt_at: now, completed_at: null, updated_at: now }))
      .where("webhook_id", "=", id)
      .where("status", "=", "dead_letter")
      .where("last_error", "like", "refused:%")
      .execute();
  }

  /** Deletes the webhook with its deliveries and their attempts: pending ones are never sent. */
  async function remove(id: string): Promise<{ id: string; deleted: true }> {
    await db.transaction().execute(async (tx) => {
      const gone = await tx.deleteFrom("webhooks").where("id", "=", id).executeTakeFirst();
      if (Number(gone.numDeletedRows) === 0) throw new KilnError("not_found", `No webhook ${id}`);
      const ids = tx.selectFrom("webhook_deliveries").select("id").where("webhook_id", "=", id);
      await tx.deleteFrom("webhook_delivery_attempts").where("delivery_id", "in", ids).execute();
      await tx.deleteFrom("webhook_deliveries").where("webhook_id", "=", id).execute();
    });
    return { id, deleted: true };
  }

  async function attemptsOf(ids: string[]): Promise<Map<string, DeliveryAttemptRow[]>> {
    const out = new Map<string, DeliveryAttemptRow[]>(ids.map((id) => [id, []]));
    if (ids.length === 0) return out;
    const rows = await db.selectFrom("webhook_delivery_attempts").selectAll().where("delivery_id", "in", ids).orderBy("delivery_id").orderBy("attempt").execute();
    for (const r of rows) out.get(r.delivery_id)!.push(r);
    return out;
  }

  /** Newest first; `status` narrows the list. */
  async function listDeliveries(webhookId: string, opts: { limit: number; after?: [string, string]; status?: DeliveryStatus }): Promise<Page<DeliveryView>> {
    await load(webhookId);
    let q = db.selectFrom("webhook_deliveries").selectAll().where("webhook_id", "=", webhookId);
    if (opts.status) q = q.where("status", "=", opts.status);
    const page = await newestFirstPage(q, opts);
    const attempts = await attemptsOf(page.rows.map((r) => r.id));
    return { items: page.rows.map((r) => deliveryView(r, attempts.get(r.id)!)), last: page.last, more: page.more };
  }

  async function loadDelivery(webhookId: string, deliveryId: string): Promise<DeliveryRow> {
    const row = await db.selectFrom("webhook_deliveries").selectAll().where("id", "=", deliveryId).where("webhook_id", "=", webhookId).executeTakeFirst();
    if (!row) throw new KilnError("not_found", `No delivery ${deliveryId} of webhook ${webhookId}`);
    return row;
  }

  /** Delivery detail: status, every attempt, and the payload exactly as sent. */
  async function getDelivery(webhookId: string, deliveryId: string): Promise<DeliveryView & { payload: unknown }> {
    const row = await loadDelivery(webhookId, deliveryId);
    const attempts = await attemptsOf([row.id]);
    return { ...deliveryView(row, attempts.get(row.id)!), payload: JSON.parse(row.body) as unknown };
  }

  /** Queues a dead letter again for one more run of the retry schedule. */
  async function retryDelivery(webhookId: string, deliveryId: string): Promise<DeliveryView> {
    const row = await loadDelivery(webhookId, deliveryId);
    if (row.status !== "dead_letter") throw new KilnError("conflict", `Delivery ${deliveryId} is ${row.status}; only a dead_letter delivery can be retried`);
    const now = new Date().toISOString();
    const updated = await db
      .updateTable("webhook_deliveries")
      .set({ status: "queued", schedule_base: row.attempts, next_attempt_at: now, completed_at: null, updated_at: now })
      .where("id", "=", deliveryId)
      .where("status", "=", "dead_letter")
      .executeTakeFirst();
    if (Number(updated.numUpdatedRows) === 0) throw new KilnError("conflict", `Delivery ${deliveryId} changed meanwhile; look again`);
    deps.wake();
    const fresh = await loadDelivery(webhookId, deliveryId);
    return deliveryView(fresh, (await attemptsOf([fresh.id])).get(fresh.id)!);
  }

  /**
   * Sends a delivery's event again as a new delivery (any status: also one that succeeded) to the webhook's current
   * URL, signed with its current secrets: same event id and body, a new delivery id, a fresh retry schedule.
   */
  async function replayDelivery(webhookId: string, deliveryId: string): Promise<DeliveryView> {
    const id = newId("dlv");
    await db.transaction().execute(async (tx) => {
      // A no-op write takes the webhook's row lock (PostgreSQL; SQLite has one writer): concurrent replays of one
      // webhook count its pending deliveries one after another, so together they cannot pass the bound.
      await tx.updateTable("webhooks").set((eb) => ({ enabled: eb.ref("enabled") })).where("id", "=", webhookId).execute();
      const hook = await tx.selectFrom("webhooks").select(["id", "enabled"]).where("id", "=", webhookId).executeTakeFirst();
      if (!hook) throw new KilnError("not_found", `No webhook ${webhookId}`);
      const row = await tx.selectFrom("webhook_deliveries").selectAll().where("id", "=", deliveryId).where("webhook_id", "=", webhookId).executeTakeFirst();
      if (!row) throw new KilnError("not_found", `No delivery ${deliveryId} of webhook ${webhookId}`);
      if (hook.enabled !== 1) throw new KilnError("conflict", `Webhook ${webhookId} is disabled; enable it to replay its deliveries`);
      const pending = await tx
        .selectFrom("webhook_deliveries")
        .select((eb) => eb.fn.countAll<number>().as("n"))
        .where("webhook_id", "=", webhookId)
        .where("status", "in", ["queued", "in_progress"])
        .executeTakeFirstOrThrow();
      if (Number(pending.n) >= MAX_PENDING_DELIVERIES_PER_WEBHOOK) {
        throw new KilnError("rate_limited", `Webhook ${webhookId} has ${MAX_PENDING_DELIVERIES_PER_WEBHOOK} deliveries waiting to be sent; replay again when they are done`, {
          detail: { retryable: true },
        });
      }
      const now = new Date().toISOString();
      await tx
        .insertInto("webhook_deliveries")
        .values(queuedDelivery({ id, webhookId, eventId: row.event_id, operation: row.operation, body: row.body, now }))
        .execute();
    });
    deps.wake();
    const fresh = await loadDelivery(webhookId, id);
    return deliveryView(fresh, (await attemptsOf([fresh.id])).get(fresh.id)!);
  }

  return { create, get, list, update, remove, listDeliveries, getDelivery, retryDelivery, replayDelivery };
}
