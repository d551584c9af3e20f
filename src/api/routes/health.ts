// Health (public liveness) and readiness (store, driver and the capacity machines use, authenticated).

import { Type } from "typebox";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { errors } from "../schemas.ts";

const ReadyBody = Type.Object({
  status: Type.Union([Type.Literal("ready"), Type.Literal("not_ready")]),
  store: Type.Object({ dialect: Type.String(), ok: Type.Boolean(), error: Type.Optional(Type.String()) }),
  driver: Type.Object({}, { additionalProperties: true }),
  capacity: Type.Object(
    {
      host_cores: Type.Integer(),
      host_memory_mb: Type.Integer(),
      live_machines: Type.Integer({ description: "Machines creating, running or hibernated" }),
      declared_memory_mb: Type.Integer({ description: "Sum of memory_mb of those machines" }),
      mem_available_mb: Type.Integer({ description: "The host's MemAvailable" }),
      min_free_memory_mb: Type.Integer({ description: "Below this, creates answer 503 (KILN_MIN_FREE_MEMORY_MB)" }),
      free_disk_mb: Type.Union([Type.Integer(), Type.Null()], { description: "Free space of the data dir's filesystem" }),
      min_free_disk_mb: Type.Integer({ description: "Below this, creates answer 503 (KILN_MIN_FREE_DISK_MB)" }),
      max_disk_mb: Type.Integer(),
      memory_overcommit: Type.Union([Type.Number(), Type.Null()]),
      accepting: Type.Boolean({ description: "False while a floor is crossed: creates answer 503" }),
    },
    { description: "What machines use of the host, and the floors creates are held to" },
  ),
});

export async function healthRoutes(app: App, opts: { services: Services }) {
  const { store, driver, admission } = opts.services;
  // Readiness probes arrive often and from many places: the store is asked at most every 250 ms.
  let lastPing: { at: number; error: string | undefined } | undefined;
  async function storeError(): Promise<string | undefined> {
    if (lastPing && Date.now() - lastPing.at < 250) return lastPing.error;
    let error: string | undefined;
    try {
      await store.ping();
    } catch (err) {
      error = (err as Error).message;
    }
    lastPing = { at: Date.now(), error };
    return error;
  }

  app.get(
    "/health",
    { config: { public: true }, schema: { tags: ["Health"], summary: "Process liveness", security: [], response: { 200: Type.Object({ status: Type.Literal("ok") }) } } },
    async () => ({ status: "ok" as const }),
  );

  app.get(
    "/v1/ready",
    { schema: { tags: ["Health"], summary: "Store and driver readiness, and what the host enforces", response: { 200: ReadyBody, 503: ReadyBody, ...errors() } } },
    async (_req, reply) => {
      const error = await storeError();
      const [readiness, capacity] = await Promise.all([driver.readiness(), admission.capacity()]);
      const ready = error === undefined && readiness.ready;
      const body = {
        status: ready ? ("ready" as const) : ("not_ready" as const),
        store: { dialect: store.dialect, ok: error === undefined, ...(error ? { error } : {}) },
        driver: readiness as unknown as Record<string, unknown>,
        capacity,
      };
      return ready ? reply.code(200).send(body) : reply.code(503).send(body);
    },
  );
}
