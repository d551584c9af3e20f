// Verifying a Kiln webhook delivery (docs/webhooks.md): HMAC-SHA256 over "<x-service-event-id>.<x-service-timestamp>.
// <raw body>", keyed with the base64 part of a `whsec_…` secret (any other secret: its UTF-8 bytes), sent as
// `x-service-signature: v1,<base64>` (several, space-separated, while a rotated secret is in grace).

import { createHmac, timingSafeEqual } from "node:crypto";

export class WebhookVerificationError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "WebhookVerificationError";
  }
}

export interface WebhookEvent {
  id: string;
  operation: string;
  occurred_at: string;
  machine: Record<string, unknown>;
  [key: string]: unknown;
}

type Headers = Record<string, string | string[] | undefined> | globalThis.Headers;

function header(headers: Headers, name: string): string | undefined {
  const v = headers instanceof globalThis.Headers ? headers.get(name) : headers[name] ?? headers[name.toLowerCase()];
  return Array.isArray(v) ? v[0] : (v ?? undefined);
}

function keyOf(secret: string): Buffer {
  return secret.startsWith("whsec_") ? Buffer.from(secret.slice(6), "base64") : Buffer.from(secret, "utf8");
}

/**
 * Checks a delivery's signature and age and returns its parsed event; throws WebhookVerificationError otherwise.
 * `body` must be the raw bytes received (not re-serialised JSON). `toleranceS` bounds replays (default 300 s).
 */
export function verifyWebhook(secret: string, headers: Headers, body: string | Uint8Array, opts: { toleranceS?: number; now?: Date } = {}): WebhookEvent {
  const eventId = header(headers, "x-service-event-id");
  const timestamp = header(headers, "x-service-timestamp");
  const signatures = header(headers, "x-service-signature");
  if (!eventId || !timestamp || !signatures) throw new WebhookVerificationError("missing x-service-event-id, x-service-timestamp or x-service-signature");
  if (!/^\d{1,12}$/.test(timestamp)) throw new WebhookVerificationError("x-service-timestamp is not a Unix time");
  const now = Math.floor((opts.now ?? new Date()).getTime() / 1000);
  const tolerance = opts.toleranceS ?? 300;
  if (Math.abs(now - Number(timestamp)) > tolerance) throw new WebhookVerificationError(`the delivery's timestamp is more than ${tolerance} s from now`);
  const raw = typeof body === "string" ? Buffer.from(body, "utf8") : Buffer.from(body);
  const want = createHmac("sha256", keyOf(secret)).update(`${eventId}.${timestamp}.`).update(raw).digest();
  const ok = signatures.split(" ").some((s) => {
    const [version, mac] = s.split(",", 2);
    if (version !== "v1" || !mac) return false;
    const got = Buffer.from(mac, "base64");
    return got.length === want.length && timingSafeEqual(got, want);
  });
  if (!ok) throw new WebhookVerificationError("no signature matches this secret");
  return JSON.parse(raw.toString("utf8")) as WebhookEvent;
}
