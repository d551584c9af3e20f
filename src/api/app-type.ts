// The Fastify instance type every route plugin receives, and what Kiln adds to Fastify's request and route config.
// Kept apart from server.ts so routes depend on this, not on the module that registers them.

import type { FastifyInstance } from "fastify";
import type { TypeBoxTypeProvider } from "@fastify/type-provider-typebox";
import type { Logger } from "../log.ts";
import type { AuthKind, RouteAuth } from "./auth.ts";

export type App = FastifyInstance<any, any, any, Logger, TypeBoxTypeProvider>;

declare module "fastify" {
  interface FastifyInstance {
    /** Every registered route with its declared auth (auth.ts). */
    routeTable(): RouteAuth[];
  }
  interface FastifyRequest {
    apiKeyId?: string;
    /** The host that forwarded this request (a signed cluster request, src/hosts/cluster-auth.ts); unset otherwise. */
    forwardedBy?: string;
  }
  interface FastifyContextConfig {
    /** How the route is authenticated (auth.ts): every route must say; the server refuses to start otherwise. */
    auth?: AuthKind;
  }
}
