// Webhook signatures: Standard Webhooks (HMAC-SHA256 over "<event id>.<timestamp>.<body>") carried under both
// Kiln's x-service-* header names and the standard webhook-* ones, so stock verifiers work unchanged.

import { createHmac, createSecretKey, randomBytes } from "node:crypto";
import type { KeyObject } from "node:crypto";

export const SIGNATURE_VERSION = "v1";
const PREFIX = "whsec_";

/** A new secret in Standard Webhooks' form: `whsec_` + base64 of 32 random bytes. */
export function generateSecret(): string {
  return PREFIX + randomBytes(32).toString("base64");
}

/**
 * The HMAC key of a secret: the base64-decoded part of a `whsec_…` secret (as Standard Webhooks does), or the
 * UTF-8 bytes of any other secret.
 */
export function secretKey(secret: string): Buffer {
  return secret.startsWith(PREFIX) ? Buffer.from(secret.slice(PREFIX.length), "base64") : Buffer.from(secret, "utf8");
}

/** Why a secret cannot be used, or null when it can. */
export function secretProblem(secret: string): string | null {
  if (secret.startsWith(PREFIX)) {
    const rest = secret.slice(PREFIX.length);
    if (!/^[A-Za-z0-9+/]+={0,2}$/.test(rest) || rest.length % 4 !== 0) return "a whsec_ secret must be whsec_ followed by base64";
    const bytes = Buffer.from(rest, "base64").length;
    if (bytes < 16 || bytes > 128) return `a whsec_ secret must hold 16 to 128 bytes, this one holds ${bytes}`;
    return null;
  }
  if (secret.length < 16) return "a signing secret must be at least 16 characters";
  return null;
}

// Key objects of recently used secrets: making one per signature costs more than the HMAC of a small body.
const keys = new Map<string, KeyObject>();

function keyObject(secret: string): KeyObject {
  let key = keys.get(secret);
  if (!key) {
    if (keys.size >= 256) keys.delete(keys.keys().next().value!);
    key = createSecretKey(secretKey(secret));
    keys.set(secret, key);
  }
  return key;
}

/** `v1,<base64 HMAC-SHA256>` of one delivery under one secret. */
export function sign(secret: string, eventId: string, timestamp: number, body: string): string {
  const mac = createHmac("sha256", keyObject(secret)).update(`${eventId}.${timestamp}.${body}`).digest("base64");
  return `${SIGNATURE_VERSION},${mac}`;
}

export interface SigningInput {
  webhookId: string;
  deliveryId: string;
  eventId: string;
  body: string;
  /** Current secret first, then a rotated-out one still in its grace period. */
  secrets: string[];
  /** Unix seconds of this attempt (a fresh one on every attempt, so receivers' replay windows hold). */
  timestamp: number;
}

/** Every header a delivery carries besides content-type. */
export function deliveryHeaders(input: SigningInput): Record<string, string> {
  const signature = input.secrets.map((s) => sign(s, input.eventId, input.timestamp, input.body)).join(" ");
  const timestamp = String(input.timestamp);
  return {
    "x-service-webhook-id": input.webhookId,
    "x-service-delivery-id": input.deliveryId,
    "x-service-event-id": input.eventId,
    "x-service-signature-version": SIGNATURE_VERSION,
    "x-service-signature": signature,
    "x-service-timestamp": timestamp,
    "webhook-id": input.eventId,
    "webhook-timestamp": timestamp,
    "webhook-signature": signature,
  };
}
