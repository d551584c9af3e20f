// The matched route's config, read once per request. Fastify's `req.routeOptions` is a getter that builds a new
// object of every route option on each read; the hooks that run on every request (auth, cluster routing, the
// request log) read the route several times, so they share one read.

import type { FastifyContextConfig, FastifyRequest } from "fastify";

/** The route's `config` as Fastify keeps it: what the route declared, plus its `url` and `method` (no url: unmatched). */
export type RouteConfig = FastifyContextConfig & { url?: string; method?: string | string[]; [key: string]: unknown };

const kConfig = Symbol("kiln.routeConfig");
type Remembering = FastifyRequest & { [kConfig]?: RouteConfig };

export function routeConfigOf(req: FastifyRequest): RouteConfig {
  const r = req as Remembering;
  return (r[kConfig] ??= (req.routeOptions.config ?? {}) as RouteConfig);
}
