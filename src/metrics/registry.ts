// The operators' metrics (prom-client), one registry per server: request latencies from one onResponse hook, events
// the services publish (events.ts), and what the store and the warm pool hold, read at scrape time — so counts of
// machines, builds and the webhook backlog are right after a restart and across hosts sharing one store.

import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from "prom-client";
import type { ServerResponse } from "node:http";
import { sql } from "kysely";
import type { Db } from "../store/schema.ts";
import { onMetricEvents } from "./events.ts";
import type { HotPoolStats } from "../machines/hot-pools.ts";

/** Seconds; from a warm-pool create (~10 ms) to a cold build-machine boot or a long exec (minutes). */
const LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300];

/** Which route's answers feed which named histogram (route patterns as Fastify registers them). */
const NAMED_ROUTES: Record<string, "create" | "exec" | "fork"> = {
  "POST /v1/machines": "create",
  "POST /sandboxes": "create",
  "POST /v2/sandboxes": "create",
  "POST /v1/machines/:id/exec": "exec",
  "POST /v1/machines/:id/fork": "fork",
};

export interface MetricsSources {
  db: Db;
  /** The warm pool's target size and machines ready now. */
  warmPool: () => { size: number; ready: number };
  /** Hot templates' pools (hot-pools.ts); only those with a pool are reported, so their labels stay few. */
  hotPools?: () => HotPoolStats[];
}

export function createMetrics(sources: MetricsSources) {
  const registry = new Registry();
  collectDefaultMetrics({ register: registry, prefix: "kiln_" });

  const requests = new Histogram({
    name: "kiln_http_request_duration_seconds",
    help: "API requests by method, route pattern and status, answered (time to the last byte of the answer)",
    labelNames: ["method", "route", "status"],
    buckets: LATENCY_BUCKETS,
    registers: [registry],
  });
  const named = {
    create: new Histogram({ name: "kiln_machine_create_duration_seconds", help: "Machine creates (Kiln and E2B APIs) by outcome", labelNames: ["outcome"], buckets: LATENCY_BUCKETS, registers: [registry] }),
    exec: new Histogram({ name: "kiln_exec_duration_seconds", help: "One-shot execs (POST /v1/machines/{id}/exec) by outcome", labelNames: ["outcome"], buckets: LATENCY_BUCKETS, registers: [registry] }),
    fork: new Histogram({ name: "kiln_machine_fork_duration_seconds", help: "Machine forks by outcome", labelNames: ["outcome"], buckets: LATENCY_BUCKETS, registers: [registry] }),
  };
  const edge = new Histogram({ name: "kiln_edge_request_duration_seconds", help: "Requests through the public edge (/edge/…) by status class", labelNames: ["status"], buckets: LATENCY_BUCKETS, registers: [registry] });

  const poolTakes = new Counter({ name: "kiln_warm_pool_takes_total", help: "Creates that asked the warm pool, by whether they got a pooled machine (hit) or booted one (miss)", labelNames: ["outcome"], registers: [registry] });
  const refusals = new Counter({ name: "kiln_admission_refusals_total", help: "Machine creates turned away (503) while the host was short of a resource", labelNames: ["reason"], registers: [registry] });
  const attempts = new Histogram({ name: "kiln_webhook_attempt_duration_seconds", help: "Webhook delivery attempts by outcome (ok: a 2xx in time)", labelNames: ["outcome"], buckets: LATENCY_BUCKETS, registers: [registry] });
  for (const o of ["hit", "miss"]) poolTakes.inc({ outcome: o }, 0);
  for (const r of ["memory", "disk", "overcommit"]) refusals.inc({ reason: r }, 0);

  new Gauge({
    name: "kiln_warm_pool_size",
    help: "Machines the warm pool keeps booted (KILN_WARM_POOL)",
    registers: [registry],
    collect() {
      this.set(sources.warmPool().size);
    },
  });
  new Gauge({
    name: "kiln_warm_pool_ready",
    help: "Pooled machines booted and waiting now",
    registers: [registry],
    collect() {
      this.set(sources.warmPool().ready);
    },
  });
  // Hot templates' pools, read at scrape time like the warm pool's. A template is a label only while it has a pool
  // (at most KILN_HOT_POOL_TOTAL of them at once); its takes count from the pool's making (a new pool starts again
  // at 0, which Prometheus reads as a counter reset).
  const hotPools = () => (sources.hotPools?.() ?? []).filter((t) => t.pooled);
  const hotLabels = (t: HotPoolStats) => ({ template: t.template, artifact_id: t.artifact_id });
  new Gauge({
    name: "kiln_hot_pool_size",
    help: "Machines a hot template's pool keeps booted now (its demand, within KILN_HOT_POOL_MAX)",
    labelNames: ["template", "artifact_id"],
    registers: [registry],
    collect() {
      this.reset();
      for (const t of hotPools()) this.set(hotLabels(t), t.size);
    },
  });
  new Gauge({
    name: "kiln_hot_pool_ready",
    help: "A hot template's pooled machines booted, prepared and waiting now",
    labelNames: ["template", "artifact_id"],
    registers: [registry],
    collect() {
      this.reset();
      for (const t of hotPools()) this.set(hotLabels(t), t.ready);
    },
  });
  new Counter({
    name: "kiln_hot_pool_takes_total",
    help: "Creates of a hot template that asked its pool, by whether they got a pooled machine (hit) or booted one (miss)",
    labelNames: ["template", "artifact_id", "outcome"],
    registers: [registry],
    collect() {
      this.reset();
      for (const t of hotPools()) for (const outcome of ["hit", "miss"] as const) this.inc({ ...hotLabels(t), outcome }, t.takes[outcome]);
    },
  });
  new Gauge({
    name: "kiln_machines",
    help: "Machines in the store by status and host (destroyed ones excluded)",
    labelNames: ["status", "host_id"],
    registers: [registry],
    async collect() {
      const rows = await sources.db
        .selectFrom("machines")
        .select(["status", "host_id", sql<number>`count(*)`.as("n")])
        .where("status", "!=", "destroyed")
        .groupBy(["status", "host_id"])
        .execute();
      this.reset();
      for (const r of rows) this.set({ status: r.status, host_id: r.host_id ?? "" }, Number(r.n));
    },
  });
  new Gauge({
    name: "kiln_builds",
    help: "Template builds in the build history by status (ready, error and cancelled are outcomes)",
    labelNames: ["status"],
    registers: [registry],
    async collect() {
      const rows = await sources.db.selectFrom("builds").select(["status", sql<number>`count(*)`.as("n")]).groupBy("status").execute();
      this.reset();
      for (const status of ["waiting", "building", "ready", "error", "cancelled"]) this.set({ status }, 0);
      for (const r of rows) this.set({ status: r.status }, Number(r.n));
    },
  });
  // Snapshots by host: what they hold is on that host's data dir (shared reflinked blocks count in full).
  const snapshotsByHost = () =>
    sources.db
      .selectFrom("snapshots")
      .select(["host_id", sql<number>`count(*)`.as("n"), sql<number>`coalesce(sum(size_bytes), 0)`.as("bytes")])
      .where("status", "=", "ready")
      .groupBy("host_id")
      .execute();
  for (const [name, help, field] of [
    ["kiln_snapshots", "Ready snapshots by host", "n"],
    ["kiln_snapshot_bytes", "Bytes the ready snapshots hold on disk, by host (blocks shared with machines count in full)", "bytes"],
  ] as const) {
    new Gauge({
      name,
      help,
      labelNames: ["host_id"],
      registers: [registry],
      async collect() {
        const rows = await snapshotsByHost();
        this.reset();
        for (const r of rows) this.set({ host_id: r.host_id }, Number(r[field]));
      },
    });
  }
  const backlogAge = new Gauge({ name: "kiln_webhook_backlog_oldest_seconds", help: "Age of the oldest webhook delivery not yet succeeded or dead-lettered (0 when none)", registers: [registry] });
  new Gauge({
    name: "kiln_webhook_backlog",
    help: "Webhook deliveries queued or in progress",
    registers: [registry],
    async collect() {
      const row = await sources.db
        .selectFrom("webhook_deliveries")
        .select([sql<number>`count(*)`.as("n"), sql<string | null>`min(created_at)`.as("oldest")])
        .where("status", "in", ["queued", "in_progress"])
        .executeTakeFirst();
      this.set(Number(row?.n ?? 0));
      backlogAge.set(row?.oldest ? Math.max(0, (Date.now() - Date.parse(row.oldest)) / 1000) : 0);
    },
  });

  const unsubscribe = onMetricEvents({
    warmPoolTake: (e) => poolTakes.inc({ outcome: e.hit ? "hit" : "miss" }),
    admissionRefused: (e) => refusals.inc({ reason: e.reason }),
    webhookAttempt: (e) => attempts.observe({ outcome: e.ok ? "ok" : "failed" }, e.durationMs / 1000),
  });

  return {
    registry,
    /** One answered API request (Fastify's onResponse): `route` is the matched pattern, or "unmatched". */
    observeRequest(method: string, route: string, status: number, seconds: number) {
      requests.observe({ method, route, status: String(status) }, seconds);
      const which = NAMED_ROUTES[`${method} ${route}`];
      if (which) named[which].observe({ outcome: status < 400 ? "ok" : "error" }, seconds);
    },
    /** One request the edge proxied: observed when its answer is done (or the client left). */
    observeEdge(res: ServerResponse) {
      const start = performance.now();
      res.once("close", () => edge.observe({ status: `${Math.floor(res.statusCode / 100)}xx` }, (performance.now() - start) / 1000));
    },
    close: unsubscribe,
  };
}

export type Metrics = ReturnType<typeof createMetrics>;
