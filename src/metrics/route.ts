// GET /metrics on the API port (request latencies are observed by the server's one onResponse hook): Prometheus text format, behind an API key (Prometheus sends it with its
// `authorization` bearer setting), like every route but /health.

import type { App } from "../api/app-type.ts";
import type { Metrics } from "./registry.ts";

export async function metricsRoutes(app: App, opts: { metrics: Metrics }) {
  const { metrics } = opts;
  app.addHook("onClose", (_app, done) => {
    metrics.close();
    done();
  });

  app.get(
    "/metrics",
    { config: { auth: "key" }, schema: { tags: ["Monitor"], summary: "Operators' metrics in Prometheus text format (docs/metrics.md)" } },
    async (_req, reply) => reply.type(metrics.registry.contentType).send(await metrics.registry.metrics()),
  );
}
