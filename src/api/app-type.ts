// The Fastify instance type every route plugin receives, and what Kiln adds to Fastify's request and route config.
// Kept apart from server.ts so routes depend on this, not on the module that registers them.

import type { FastifyInstance } from "fastify";
import type { TypeBoxTypeProvider } from "@fastify/type-provider-typebox";
import type { Logger } from "../log.ts";

export type App = FastifyInstance<any, any, any, Logger, TypeBoxTypeProvider>;

declare module "fastify" {
  interface FastifyRequest {
    apiKeyId?: string;
  }
  interface FastifyContextConfig {
    /** Routes under /v1 that need no bearer key. */
    public?: boolean;
  }
}
