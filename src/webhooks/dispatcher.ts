// The delivery worker: claims due deliveries from the outbox (FOR UPDATE SKIP LOCKED on PostgreSQL, so several
// servers share one store), sends them signed, records every attempt, retries on schedule and dead-letters.
// Long on purpose: claim, send, record and reschedule are one delivery's transaction story, read top to bottom.

import { Agent, request } from "undici";
import { sql } from "kysely";
import type { Db, DeliveryRow, WebhookRow } from "../store/schema.ts";
import type { Logger } from "../log.ts";
import { deliveryHeaders } from "./signing.ts";
import { addressProblem, guardedLookup, ipLiteral, ReceiverRefusedError } from "./ssrf.ts";
import type { Resolve } from "./ssrf.ts";
import { onDeliveriesQueued } from "./outbox.ts";
import { pruneWebhookHistory } from "./history.ts";
import { metricEvents } from "../metrics/events.ts";

export const DELIVERY_STATUSES = ["queued", "in_progress", "succeeded", "dead_letter"] as const;
export type DeliveryStatus = (typeof DELIVERY_STATUSES)[number];

/** Each attempt's bound, DESIGN.md §4. */
export const ATTEMPT_TIMEOUT_MS = 15_000;
/** How much of a response is read, and how much of it is kept on the attempt. */
const BODY_READ_CAP = 64 * 1024;
const EXCERPT_CHARS = 512;
const MAX_RETRY_AFTER_MS = 24 * 3600_000;

export interface DispatcherOptions {
  db: Db;
  dialect: "sqlite" | "postgres";
  hostId: string;
  log: Logger;
  /** Delay before each attempt; the first is 0 (an event's first attempt goes at once). */
  scheduleMs: number[];
  allowPrivate: boolean;
  timeoutMs?: number;
  /** Requests in flight at once, overall and to one webhook: a slow receiver can hold only its own share. */
  maxInFlight?: number;
  maxPerWebhook?: number;
  /** Longest sleep between looks at the store: other servers' inserts on PostgreSQL, expired claims. */
  idleMs?: number;
  /** How receiver names are resolved (dns.lookup); tests give names addresses DNS here cannot. */
  resolve?: Resolve;
  /** How long finished deliveries, their attempts and their events are kept (0 or absent: forever). */
  historyS?: number;
}

/** How often the history is pruned (and once at start). */
const HISTORY_PRUNE_EVERY_MS = 3_600_000;

/** What sending needs of a webhook, read with the claim so a PATCH (new URL, rotated secret) applies to the next attempt. */
type HookTarget = Pick<WebhookRow, "url" | "signing_secret" | "previous_signing_secret" | "previous_secret_expires_at" | "allow_private"> & { webhook_id: string };

interface Outcome {
  row: DeliveryRow;
  startedAt: string;
  durationMs: number;
  statusCode: number | null;
  error: string | null;
  excerpt: string | null;
  status: DeliveryStatus;
  nextAttemptAt: string;
  disableWebhook: boolean;
}

export function createDispatcher(opts: DispatcherOptions) {
  const { db, hostId, log } = opts;
  const timeoutMs = opts.timeoutMs ?? ATTEMPT_TIMEOUT_MS;
  const maxInFlight = opts.maxInFlight ?? 256;
  const maxPerWebhook = opts.maxPerWebhook ?? 32;
  const idleMs = opts.idleMs ?? (opts.dialect === "postgres" ? 1000 : 30_000);
  // A claim outlives the longest attempt by a wide margin; past it, another server may take the delivery over.
  const claimTtlMs = timeoutMs * 4;
  // One connection pool per address policy: a webhook with allow_private (the operator's say) may reach private
  // receivers; the others only when the whole server allows it. Link-local is refused by both.
  const agentFor = (allowPrivate: boolean) => new Agent({ connect: { lookup: guardedLookup(allowPrivate, opts.resolve), timeout: Math.min(10_000, timeoutMs) }, keepAliveTimeout: 4_000 });
  const agent = agentFor(opts.allowPrivate);
  const privateAgent = opts.allowPrivate ? agent : agentFor(true);

  let inFlight = 0;
  const perWebhook = new Map<string, number>();
  const sending = new Set<Promise<void>>();
  let claiming = false;
  let again = false;
  let closed = true;
  let timer: NodeJS.Timeout | undefined;
  let recoverTimer: NodeJS.Timeout | undefined;
  let historyTimer: NodeJS.Timeout | undefined;
  let unsubscribe: (() => void) | undefined;
  const pending: Outcome[] = [];
  let flushing: Promise<void> | undefined;
  let wakeQueued = false;

  /**
   * Claims what is due. Calls within one turn of the event loop (a burst of finished sends, a batch of events) are
   * folded into one claim, so deliveries are claimed — and their outcomes written — in batches under load.
   */
  function wake(): void {
    if (closed || wakeQueued) return;
    if (claiming) {
      again = true;
      return;
    }
    wakeQueued = true;
    setImmediate(() => {
      wakeQueued = false;
      if (closed) return;
      if (claiming) {
        again = true;
        return;
      }
      claiming = true;
      void claimLoop().finally(() => {
        claiming = false;
        if (again && !closed) wake();
      });
    });
  }

  function saturated(): string[] {
    return [...perWebhook].filter(([, n]) => n >= maxPerWebhook).map(([id]) => id);
  }

  async function claimLoop(): Promise<void> {
    try {
      do {
        again = false;
        const free = maxInFlight - inFlight;
        if (free <= 0) return; // a finishing send wakes us
        const rows = await claim(free, saturated());
        if (rows.length > 0) startAll(rows);
        if (rows.length === free) again = true;
      } while (again && !closed);
      await armTimer();
    } catch (err) {
      if (closed) return;
      log.error({ err }, "claiming webhook deliveries failed; trying again shortly");
      arm(1000);
    }
  }

  /**
   * Takes up to n due deliveries of enabled webhooks for this server, at most a webhook's remaining share of each.
   * Webhooks already at their share are left out of the query, so their backlog does not crowd out the others.
   */
  async function claim(n: number, skip: string[]): Promise<{ row: DeliveryRow; hook: HookTarget }[]> {
    const now = new Date();
    const nowIso = now.toISOString();
    const skipClause = skip.length > 0 ? sql`and d.webhook_id not in (${sql.join(skip)})` : sql``;
    // Oldest due first, straight off the covering (status, next_attempt_at, id, webhook_id) index.
    const candidates = await sql<{ id: string } & HookTarget>`
      select d.id, w.id as webhook_id, w.url, w.signing_secret, w.previous_signing_secret, w.previous_secret_expires_at, w.allow_private
      from webhook_deliveries d join webhooks w on w.id = d.webhook_id
      where d.status = 'queued' and d.next_attempt_at <= ${nowIso} and w.enabled = 1 ${skipClause}
      order by d.next_attempt_at, d.id limit ${n * 4}`.execute(db);
    // Each webhook gets only what it has left of its share, counting the requests already in flight to it.
    const taken = new Map<string, number>();
    const chosen = candidates.rows.filter((c) => {
      const n = (taken.get(c.webhook_id) ?? perWebhook.get(c.webhook_id) ?? 0) + 1;
      if (n > maxPerWebhook) return false;
      taken.set(c.webhook_id, n);
      return true;
    });
    if (chosen.length === 0) return [];
    const ids = sql.join(chosen.map((r) => r.id));
    const expires = new Date(now.getTime() + claimTtlMs).toISOString();
    // The status check is repeated under the row lock; SKIP LOCKED lets several servers claim side by side.
    const which = opts.dialect === "postgres" ? sql`id in (select id from webhook_deliveries where id in (${ids}) and status = 'queued' for update skip locked)` : sql`id in (${ids}) and status = 'queued'`;
    const claimed = await sql<DeliveryRow>`
      update webhook_deliveries set status = 'in_progress', attempts = attempts + 1, claimed_by = ${hostId},
        claimed_at = ${nowIso}, claim_expires_at = ${expires}, updated_at = ${nowIso}
      where ${which} returning *`.execute(db);
    const hooks = new Map(chosen.map((c) => [c.id, c]));
    return claimed.rows.map((row) => ({ row, hook: hooks.get(row.id)! }));
  }

  function startAll(claimed: { row: DeliveryRow; hook: HookTarget }[]): void {
    for (const { row, hook } of claimed) {
      inFlight++;
      perWebhook.set(row.webhook_id, (perWebhook.get(row.webhook_id) ?? 0) + 1);
      const p: Promise<void> = attempt(row, hook)
        .then(record)
        .catch((err: unknown) => log.error({ err, delivery_id: row.id }, "a webhook delivery attempt failed unexpectedly"))
        .finally(() => {
          sending.delete(p);
          inFlight--;
          const left = (perWebhook.get(row.webhook_id) ?? 1) - 1;
          if (left <= 0) perWebhook.delete(row.webhook_id);
          else perWebhook.set(row.webhook_id, left);
          wake();
        });
      sending.add(p);
    }
  }

  async function attempt(row: DeliveryRow, hook: HookTarget): Promise<Outcome> {
    const started = new Date();
    const t0 = performance.now();
    let statusCode: number | null = null;
    let error: string | null = null;
    let excerpt: string | null = null;
    let retryAfterMs = 0;
    try {
      const url = new URL(hook.url);
      const allowPrivate = opts.allowPrivate || Number(hook.allow_private) === 1;
      const literal = ipLiteral(url.hostname);
      const problem = literal ? addressProblem(literal, allowPrivate) : null;
      if (problem) throw new ReceiverRefusedError(problem);
      const secrets = [hook.signing_secret];
      if (hook.previous_signing_secret && hook.previous_secret_expires_at && hook.previous_secret_expires_at > started.toISOString()) secrets.push(hook.previous_signing_secret);
      const headers = deliveryHeaders({ webhookId: hook.webhook_id, deliveryId: row.id, eventId: row.event_id, body: row.body, secrets, timestamp: Math.floor(started.getTime() / 1000) });
      const res = await request(url, {
        method: "POST",
        headers: { ...headers, "content-type": "application/json", "user-agent": "Kiln-Webhooks/0.1" },
        body: row.body,
        dispatcher: allowPrivate ? privateAgent : agent,
        signal: AbortSignal.timeout(timeoutMs),
      });
      statusCode = res.statusCode;
      retryAfterMs = parseRetryAfter(res.headers["retry-after"], started.getTime());
      // The body is part of the attempt: one still dripping at the timeout fails it, whatever the status said.
      excerpt = await readExcerpt(res.body);
      if (statusCode >= 300 && statusCode < 400) error = `redirects are not followed (${statusCode}${res.headers.location ? ` to ${String(res.headers.location)}` : ""})`;
      else if (statusCode >= 400) error = `the receiver answered ${statusCode}`;
    } catch (err) {
      error = describe(err, timeoutMs);
      if (statusCode !== null) error += ` (the ${statusCode} answer's body did not finish)`;
    }
    const durationMs = Math.round(performance.now() - t0);
    const ok = error === null && statusCode !== null && statusCode >= 200 && statusCode < 300;
    const gone = statusCode === 410;
    const position = row.attempts - row.schedule_base; // attempts made in this round, this one included
    let status: DeliveryStatus = "succeeded";
    let nextAttemptAt = row.next_attempt_at;
    if (!ok) {
      if (gone || position >= opts.scheduleMs.length) status = "dead_letter";
      else {
        status = "queued";
        const delay = Math.max(opts.scheduleMs[position], Math.min(retryAfterMs, MAX_RETRY_AFTER_MS));
        nextAttemptAt = new Date(Date.now() + delay).toISOString();
      }
    }
    if (gone) error = "the receiver answered 410 Gone: the webhook is disabled";
    log.debug({ delivery_id: row.id, webhook_id: hook.webhook_id, attempt: row.attempts, status_code: statusCode, error, status }, "webhook delivery attempt");
    metricEvents.webhookAttempt({ durationMs, ok });
    return { row, startedAt: started.toISOString(), durationMs, statusCode, error, excerpt, status, nextAttemptAt, disableWebhook: gone };
  }

  /** Outcomes are written in batches: one transaction per flush however many attempts finished meanwhile. */
  function record(outcome: Outcome): void {
    pending.push(outcome);
    flushing ??= new Promise<void>((resolve) => setImmediate(resolve)).then(flush).finally(() => (flushing = undefined));
  }

  async function flush(): Promise<void> {
    let requeued = false;
    while (pending.length > 0) {
      const batch = pending.splice(0);
      requeued ||= batch.some((o) => o.status === "queued");
      try {
        await db.transaction().execute(async (tx) => {
          for (const o of batch) {
            const now = new Date().toISOString();
            const done = o.status === "succeeded" || o.status === "dead_letter";
            // Only the claim that sent it records it: a delivery deleted, or taken over after an expired claim, is left alone.
            const updated = await tx
              .updateTable("webhook_deliveries")
              .set({
                status: o.status,
                next_attempt_at: o.nextAttemptAt,
                claimed_by: null,
                claimed_at: null,
                claim_expires_at: null,
                last_status_code: o.statusCode,
                last_error: o.error,
                updated_at: now,
                completed_at: done ? now : null,
              })
              .where("id", "=", o.row.id)
              .where("status", "=", "in_progress")
              .where("claimed_by", "=", hostId)
              .where("attempts", "=", o.row.attempts)
              .executeTakeFirst();
            if (Number(updated.numUpdatedRows) === 0) continue;
            await tx
              .insertInto("webhook_delivery_attempts")
              .values({ delivery_id: o.row.id, attempt: o.row.attempts, started_at: o.startedAt, duration_ms: o.durationMs, status_code: o.statusCode, error: o.error, response_excerpt: o.excerpt })
              .execute();
            if (o.disableWebhook) await tx.updateTable("webhooks").set({ enabled: 0, updated_at: now }).where("id", "=", o.row.webhook_id).execute();
          }
        });
        for (const o of batch) if (o.disableWebhook) log.warn({ webhook_id: o.row.webhook_id }, "webhook receiver answered 410 Gone; webhook disabled");
      } catch (err) {
        // The claims stay in_progress and go back to the queue when they expire: delivered at least once.
        log.error({ err, deliveries: batch.length }, "recording webhook delivery attempts failed");
      }
    }
    // A retry was scheduled: the sleep until the next due delivery may have to be shorter now.
    if (requeued) wake();
  }

  /** Sleeps until the next queued delivery is due (or idleMs, to see other servers' work), unless woken first. */
  async function armTimer(): Promise<void> {
    if (closed || inFlight >= maxInFlight) return;
    // Sends in flight wake the dispatcher as they finish; a short timer covers retries of other webhooks falling
    // due meanwhile, without a query per loop.
    if (inFlight > 0) return arm(Math.min(idleMs, 1000));
    const skip = saturated();
    const skipClause = skip.length > 0 ? sql`and d.webhook_id not in (${sql.join(skip)})` : sql``;
    const next = await sql<{ next_attempt_at: string }>`
      select d.next_attempt_at from webhook_deliveries d
      where d.status = 'queued' ${skipClause} and exists (select 1 from webhooks w where w.id = d.webhook_id and w.enabled = 1)
      order by d.next_attempt_at, d.id limit 1`.execute(db);
    const due = next.rows[0]?.next_attempt_at;
    const wait = due ? Math.max(0, Date.parse(due) - Date.now()) : idleMs;
    arm(Math.min(wait, idleMs));
  }

  function arm(ms: number): void {
    if (closed) return;
    if (timer) clearTimeout(timer);
    timer = setTimeout(() => {
      timer = undefined;
      wake();
    }, ms);
    timer.unref();
  }

  /**
   * Deliveries left in_progress by a server that stopped mid-attempt go back to the queue with that attempt
   * recorded as interrupted: this server's own at once (it just started), other servers' once their claim expired.
   */
  async function recover(own: boolean): Promise<number> {
    const now = new Date().toISOString();
    let q = db.selectFrom("webhook_deliveries").select(["id", "attempts", "claimed_at", "claimed_by"]).where("status", "=", "in_progress");
    q = own ? q.where("claimed_by", "=", hostId) : q.where("claim_expires_at", "<", now);
    let recovered = 0;
    for (const r of await q.execute()) {
      await db.transaction().execute(async (tx) => {
        const updated = await tx
          .updateTable("webhook_deliveries")
          .set({ status: "queued", next_attempt_at: now, claimed_by: null, claimed_at: null, claim_expires_at: null, last_error: "interrupted: the server stopped during the attempt", updated_at: now })
          .where("id", "=", r.id)
          .where("status", "=", "in_progress")
          .where("attempts", "=", r.attempts)
          .executeTakeFirst();
        if (Number(updated.numUpdatedRows) === 0) return;
        await tx
          .insertInto("webhook_delivery_attempts")
          .values({ delivery_id: r.id, attempt: r.attempts, started_at: r.claimed_at ?? now, duration_ms: 0, status_code: null, error: "interrupted: the server stopped during the attempt", response_excerpt: null })
          .execute();
        recovered++;
      });
    }
    if (recovered > 0) log.info({ recovered }, "webhook deliveries interrupted by a stopped server are queued again");
    return recovered;
  }

  async function start(): Promise<void> {
    if (!closed) return;
    closed = false;
    await recover(true);
    await recover(false);
    unsubscribe = onDeliveriesQueued(db, wake);
    recoverTimer = setInterval(() => {
      void recover(false)
        .then((n) => n > 0 && wake())
        .catch((err: unknown) => log.error({ err }, "recovering expired webhook claims failed"));
    }, Math.max(1000, claimTtlMs / 2));
    recoverTimer.unref();
    if (opts.historyS) {
      void pruneHistory();
      historyTimer = setInterval(() => void pruneHistory(), HISTORY_PRUNE_EVERY_MS);
      historyTimer.unref();
    }
    wake();
  }

  /** Every server prunes; the deletes are idempotent, so several on one store only repeat each other's no-op. */
  function pruneHistory(): Promise<void> {
    return pruneWebhookHistory(db, new Date(Date.now() - opts.historyS! * 1000)).then(
      (n) => void (n.deliveries + n.events > 0 && log.info(n, "webhook history past its period removed")),
      (err: unknown) => log.error({ err }, "pruning webhook history failed"),
    );
  }

  /** Stops claiming, lets attempts in flight finish (each is bounded by its timeout) and records them. */
  async function close(): Promise<void> {
    if (closed) return;
    closed = true;
    unsubscribe?.();
    if (timer) clearTimeout(timer);
    if (recoverTimer) clearInterval(recoverTimer);
    if (historyTimer) clearInterval(historyTimer);
    await Promise.allSettled([...sending]);
    while (flushing) await flushing;
    await agent.close();
    if (privateAgent !== agent) await privateAgent.close();
  }

  return { start, close, wake };
}

export type Dispatcher = ReturnType<typeof createDispatcher>;

async function readExcerpt(body: AsyncIterable<Buffer> & { destroy(): unknown }): Promise<string> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of body) {
    chunks.push(chunk);
    size += chunk.length;
    if (size >= BODY_READ_CAP) {
      body.destroy();
      break;
    }
  }
  return Buffer.concat(chunks).subarray(0, BODY_READ_CAP).toString("utf8").slice(0, EXCERPT_CHARS);
}

/** Retry-After as delay-seconds or an HTTP date, in ms from now; 0 when absent or unreadable. */
export function parseRetryAfter(value: string | string[] | undefined, now: number): number {
  const v = Array.isArray(value) ? value[0] : value;
  if (!v) return 0;
  if (/^\d+$/.test(v.trim())) return Number(v.trim()) * 1000;
  const at = Date.parse(v);
  return Number.isNaN(at) ? 0 : Math.max(0, at - now);
}

function describe(err: unknown, timeoutMs: number): string {
  const e = err as { name?: string; code?: string; message?: string; cause?: { code?: string; message?: string } };
  if (err instanceof ReceiverRefusedError || e.cause instanceof ReceiverRefusedError) return `refused: ${(e.cause instanceof ReceiverRefusedError ? e.cause : e).message}`;
  if (e.name === "TimeoutError" || e.name === "AbortError") return `timed out after ${timeoutMs} ms`;
  const code = e.code ?? e.cause?.code;
  return (code ? `${code}: ` : "") + (e.message ?? String(err)).slice(0, 300);
}
