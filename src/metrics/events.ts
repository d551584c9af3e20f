// What the services tell the metrics, each a named diagnostics channel: a one-line publish where it happens, free
// when nobody listens, and no plumbing through the services' constructors. The metrics registry subscribes.

import { channel } from "node:diagnostics_channel";

export interface WarmPoolTake {
  /** A pooled machine was taken (else the create boots its own). */
  hit: boolean;
}
export interface AdmissionRefusal {
  reason: "memory" | "disk" | "overcommit";
}
export interface WebhookAttempt {
  durationMs: number;
  ok: boolean;
}

const warmPool = channel("kiln.metrics.warm_pool_take");
const admission = channel("kiln.metrics.admission_refused");
const webhook = channel("kiln.metrics.webhook_attempt");

export const metricEvents = {
  warmPoolTake: (e: WarmPoolTake) => warmPool.hasSubscribers && warmPool.publish(e),
  admissionRefused: (e: AdmissionRefusal) => admission.hasSubscribers && admission.publish(e),
  webhookAttempt: (e: WebhookAttempt) => webhook.hasSubscribers && webhook.publish(e),
};

/** Subscribes to every event; the returned function unsubscribes (a closed server stops counting). */
export function onMetricEvents(handlers: { warmPoolTake(e: WarmPoolTake): void; admissionRefused(e: AdmissionRefusal): void; webhookAttempt(e: WebhookAttempt): void }): () => void {
  const subs: [ReturnType<typeof channel>, (m: unknown) => void][] = [
    [warmPool, (m) => handlers.warmPoolTake(m as WarmPoolTake)],
    [admission, (m) => handlers.admissionRefused(m as AdmissionRefusal)],
    [webhook, (m) => handlers.webhookAttempt(m as WebhookAttempt)],
  ];
  for (const [ch, fn] of subs) ch.subscribe(fn);
  return () => {
    for (const [ch, fn] of subs) ch.unsubscribe(fn);
  };
}
