// Lifecycle webhooks: lag from a machine's lifecycle event to the receiver's 2xx, and sustained deliveries per second
// to one fast receiver (events written straight through the outbox, so the dispatcher is what is measured). The
// baselines hit the same receiver with plain fetch from the same process, in the same run.

import { createServer } from "node:http";
import { EventEmitter } from "node:events";
import { api } from "./api.ts";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { startTestKiln } from "../test/support/kiln.ts";
import { newId } from "../src/store/ids.ts";
import { announceDeliveries, enqueueDeliveries } from "../src/webhooks/outbox.ts";

const LAG_EVENTS = 200;
const BURST = 10_000;
const FETCH_CONCURRENCY = 32; // the dispatcher's share of requests in flight to one webhook

/** A receiver that answers 204 at once and reports each request's arrival time. */
async function fastReceiver() {
  const arrivals = new EventEmitter<{ hit: [path: string, at: number] }>();
  arrivals.setMaxListeners(0);
  const server = createServer((req, res) => {
    req.resume();
    req.on("end", () => {
      res.writeHead(204).end();
      arrivals.emit("hit", req.url ?? "/", performance.now());
    });
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const url = `http://127.0.0.1:${(server.address() as { port: number }).port}`;
  const count = (path: string, n: number) =>
    new Promise<number>((resolve) => {
      let seen = 0;
      const on = (p: string, at: number) => {
        if (p === path && ++seen === n) {
          arrivals.off("hit", on);
          resolve(at);
        }
      };
      arrivals.on("hit", on);
    });
  return { url, count, close: () => new Promise<void>((r) => { server.closeAllConnections(); server.close(() => r()); }) };
}

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const kiln = await startTestKiln({ env: { KILN_LOG_LEVEL: "warn", KILN_WEBHOOK_ALLOW_PRIVATE: "1", KILN_WARM_POOL: "0" }, captureLogs: false });
  const rx = await fastReceiver();
  try {
    const call = (method: string, path: string, body?: unknown) => api(kiln.url, ctx.key, method, path, body);
    const body = JSON.stringify({ id: newId("evt"), operation: "update", occurred_at: new Date().toISOString(), machine: { id: "mch_x", status: "running", metadata: {} } });

    // Lag: one lifecycle event at a time (a machine rename), timed from its commit to the receiver's answer.
    const hook = await call("POST", "/v1/lifecycle/webhooks", { url: `${rx.url}/lag`, operations: ["update"] });
    const m = await call("POST", "/v1/machines", {});
    const lag: number[] = [];
    for (let i = 0; i < LAG_EVENTS + 20; i++) {
      const got = rx.count("/lag", 1);
      const renamed = await call("PATCH", `/v1/machines/${m.id}`, { name: `n${i}` });
      // The event's occurred_at is the machine's updated_at (one clock reading in the same transaction), in ms.
      const occurred = Date.parse(renamed.updated_at) - performance.timeOrigin;
      const at = await got;
      if (i >= 20) lag.push(Math.max(0, at - occurred));
    }
    await call("DELETE", `/v1/lifecycle/webhooks/${hook.id}`);
    await call("DELETE", `/v1/machines/${m.id}`);
    const single: number[] = [];
    for (let i = 0; i < LAG_EVENTS + 20; i++) {
      const t0 = performance.now();
      const res = await fetch(`${rx.url}/single`, { method: "POST", headers: { "content-type": "application/json" }, body });
      await res.arrayBuffer();
      if (i >= 20) single.push(performance.now() - t0);
    }

    // Throughput: BURST events written through the outbox without waking the dispatcher (it sleeps: nothing else
    // is queued), then one wake, timed until the receiver has had them all.
    const burst = await call("POST", "/v1/lifecycle/webhooks", { url: `${rx.url}/burst`, operations: ["update"] });
    const db = kiln.kiln.services.store.db;
    for (let i = 0; i < BURST; i += 500) {
      await db.transaction().execute(async (tx) => {
        for (let j = i; j < Math.min(BURST, i + 500); j++) {
          const id = newId("evt");
          await enqueueDeliveries(tx, { id, operation: "update", occurredAt: new Date().toISOString(), payload: { id, operation: "update", n: j } });
        }
      });
    }
    const done = rx.count("/burst", BURST);
    const t0 = performance.now();
    announceDeliveries(db);
    const end = await done;
    const perSecond = BURST / ((end - t0) / 1000);
    await call("DELETE", `/v1/lifecycle/webhooks/${burst.id}`);

    // The same receiver, the same number of requests, FETCH_CONCURRENCY plain fetch loops.
    const f0 = performance.now();
    let next = 0;
    await Promise.all(
      Array.from({ length: FETCH_CONCURRENCY }, async () => {
        while (next < BURST) {
          next++;
          const res = await fetch(`${rx.url}/fetch`, { method: "POST", headers: { "content-type": "application/json" }, body });
          await res.arrayBuffer();
        }
      }),
    );
    const fetchPerSecond = BURST / ((performance.now() - f0) / 1000);

    return [
      {
        name: "webhook lag: lifecycle event → receiver's 2xx",
        unit: "ms",
        better: "lower",
        median: median(lag),
        p99: percentile(lag, 99),
        baseline: { name: "one plain fetch POST to the same receiver", median: median(single), p99: percentile(single, 99) },
        goal: "p50 ≤ 20 ms",
      },
      {
        name: `webhook deliveries/s to one fast receiver (${BURST} queued, SQLite)`,
        unit: "deliveries/s",
        better: "higher",
        median: perSecond,
        baseline: { name: `${FETCH_CONCURRENCY} plain fetch loops to the same receiver`, median: fetchPerSecond },
        goal: "≥ 2,000/s",
      },
    ];
  } finally {
    await rx.close();
    await kiln.close();
  }
}
