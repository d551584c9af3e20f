// Health (public liveness) and readiness (store and driver, authenticated).

import { Type } from "typebox";
import type { App } from "../server.ts";
import type { Services } from "../../services/index.ts";
import { errors } from "../schemas.ts";

export async function healthRoutes(app: App, opts: { services: Services }) {
  const { store, driver } = opts.services;

  app.get(
    "/health",
    { schema: { tags: ["Health"], summary: "Process liveness", security: [], response: { 200: Type.Object({ status: Type.Literal("ok") }) } } },
    async () => ({ status: "ok" as const }),
  );

  app.get(
    "/v1/ready",
    {
      schema: {
        tags: ["Health"],
        summary: "Store and driver readiness, and what the host enforces",
        response: {
          200: Type.Object({
            status: Type.Union([Type.Literal("ready"), Type.Literal("not_ready")]),
            store: Type.Object({ dialect: Type.String(), ok: Type.Boolean(), error: Type.Optional(Type.String()) }),
            driver: Type.Object({}, { additionalProperties: true }),
          }),
          ...errors(),
        },
      },
    },
    async (_req, reply) => {
      let storeOk = true;
      let storeError: string | undefined;
      try {
        await store.ping();
      } catch (err) {
        storeOk = false;
        storeError = (err as Error).message;
      }
      const readiness = await driver.readiness();
      const ready = storeOk && readiness.ready;
      return reply.code(ready ? 200 : 503).send({
        status: ready ? "ready" : "not_ready",
        store: { dialect: store.dialect, ok: storeOk, ...(storeError ? { error: storeError } : {}) },
        driver: readiness,
      });
    },
  );
}
