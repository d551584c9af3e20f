// Health (public liveness) and readiness (store, driver, the base template and the capacity machines use,
// authenticated). Not ready answers 503 `unavailable` (retryable) with the same body, so a script can wait on it.

import { Type } from "typebox";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { errors } from "../schemas.ts";
import { coalesce } from "../coalesce.ts";

const ReadyBody = Type.Object({
  status: Type.Union([Type.Literal("ready"), Type.Literal("not_ready")]),
  base_template: Type.Object(
    { ready: Type.Boolean(), reason: Type.Optional(Type.String()) },
    { description: "The base template (local/base) is made on first start; until it is recorded, creates from it answer 503" },
  ),
  // When not ready: the error envelope's fields beside the report (code `unavailable`, retryable).
  error: Type.Optional(Type.String()),
  code: Type.Optional(Type.Literal("unavailable")),
  request_id: Type.Optional(Type.String()),
  error_detail: Type.Optional(Type.Object({ retryable: Type.Boolean(), request_id: Type.String() })),
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
      snapshots: Type.Object(
        { count: Type.Integer({ description: "Ready snapshots this host keeps" }), bytes: Type.Integer({ description: "Bytes they hold on disk (blocks shared with machines count in full)" }) },
        { description: "Snapshots are on the data dir's filesystem: the blocks they keep apart from their machines reduce free_disk_mb, which creates, snapshots and forks are admitted by" },
      ),
      accepting: Type.Boolean({ description: "False while a floor is crossed: creates answer 503" }),
    },
    { description: "What machines use of the host, and the floors creates are held to" },
  ),
  pools: Type.Object(
    {
      warm: Type.Object(
        { size: Type.Integer({ description: "Machines of the base template it keeps booted (KILN_WARM_POOL)" }), ready: Type.Integer(), booting: Type.Integer() },
        { description: "The base template's warm pool" },
      ),
      hot: Type.Array(
        Type.Object({
          template: Type.String({ description: "The template's canonical ref" }),
          artifact_id: Type.String(),
          size: Type.Integer({ description: "Machines it keeps booted now: its recent demand, within KILN_HOT_POOL_MAX" }),
          ready: Type.Integer({ description: "Booted, prepared and waiting now" }),
          booting: Type.Integer(),
          takes: Type.Object(
            { hit: Type.Integer(), miss: Type.Integer() },
            { description: "Creates of the template since its pool was made: handed a pooled machine (hit), or booted their own (miss)" },
          ),
        }),
        { description: "Hot templates' own pools (docs/hot-pools.md), only while a template has one" },
      ),
    },
    { description: "Machines booted ahead of time: a create they fit takes one instead of booting" },
  ),
});

export async function healthRoutes(app: App, opts: { services: Services }) {
  const { store, driver, admission, templates, snapshots, pool, hotPools } = opts.services;
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

  /** The warm pool and the hot templates' pools, as they are now. */
  function pools() {
    const warm = pool.stats();
    return {
      warm: { size: warm.size, ready: warm.ready, booting: warm.booting },
      hot: hotPools
        .stats()
        .templates.filter((t) => t.pooled)
        .map((t) => ({ template: t.template, artifact_id: t.artifact_id, size: t.size, ready: t.ready, booting: t.booting, takes: t.takes })),
    };
  }

  /** The readiness report: the store, the driver, the base template, what machines use of the host, the pools. */
  async function measure() {
    const error = await storeError();
    const [readiness, admitted, held] = await Promise.all([driver.readiness(), admission.capacity(), snapshots.held()]);
    const capacity = { ...admitted, snapshots: held };
    const baseReason = templates.pendingReason();
    const ready = error === undefined && readiness.ready && baseReason === null;
    const body = {
      status: ready ? ("ready" as const) : ("not_ready" as const),
      base_template: { ready: baseReason === null, ...(baseReason ? { reason: baseReason } : {}) },
      store: { dialect: store.dialect, ok: error === undefined, ...(error ? { error } : {}) },
      driver: readiness as unknown as Record<string, unknown>,
      capacity,
      pools: pools(),
    };
    const why = error ? `the store is not reachable: ${error}` : baseReason ?? "the machine driver is not ready";
    return { ready, body, why };
  }
  // Probes that arrive together share one report (its file reads, statfs and store counts), begun after each of them
  // arrived, never an older one: the probes read in one turn of the event loop share the report begun after it. (A
  // minimum interval between reports instead made every probe wait for its tick: 32 connections got ≈ 10 k answers/s.)
  const report = coalesce(measure);
  const serialized = new WeakMap<object, string>();

  app.get(
    "/health",
    { config: { auth: "none" }, schema: { tags: ["Health"], summary: "Process liveness", security: [], response: { 200: Type.Object({ status: Type.Literal("ok") }) } } },
    async () => ({ status: "ok" as const }),
  );

  app.get(
    "/v1/ready",
    { config: { auth: "key" }, schema: { tags: ["Health"], summary: "Store, driver and base-template readiness, and what the host enforces (503 unavailable until ready)", response: { 200: ReadyBody, 503: ReadyBody, ...errors() } } },
    async (req, reply) => {
      const measured = await report();
      const { ready, body, why } = measured;
      if (ready) {
        // The probes of a batch share one report: it is turned into JSON once, by the route's own serializer.
        let json = serialized.get(measured);
        if (json === undefined) serialized.set(measured, (json = reply.getSerializationFunction("200")!(body)));
        // A string with a JSON content type goes out as it is (the type provider only knows the object form).
        return reply.code(200).type("application/json; charset=utf-8").send(json as unknown as typeof body);
      }
      return reply.code(503).send({ ...body, error: `Not ready: ${why}`, code: "unavailable" as const, request_id: req.id, error_detail: { retryable: true, request_id: req.id } });
    },
  );
}
