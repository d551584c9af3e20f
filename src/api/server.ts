// The HTTP front door: Fastify with TypeBox schemas, authentication declared by every route (auth.ts), the error
// envelope on every failure, x-request-id on every response and the OpenAPI document built from the same schemas.

import Fastify, { LogController } from "fastify";
import type { FastifyReply, FastifyRequest, FastifySchema, RouteOptions } from "fastify";
import type { App } from "./app-type.ts";
import swagger from "@fastify/swagger";
import websocket from "@fastify/websocket";
import type { TypeBoxTypeProvider } from "@fastify/type-provider-typebox";
import { KilnError, toEnvelope } from "../errors.ts";
import { newId } from "../store/ids.ts";
import { scrubUrl } from "../log.ts";
import { routeConfigOf } from "./route-config.ts";
import type { Logger } from "../log.ts";
import type { Services } from "../services/index.ts";
import { healthRoutes } from "./routes/health.ts";
import { keyRoutes } from "./routes/keys.ts";
import { machineRoutes } from "./routes/machines.ts";
import { fileRoutes } from "./routes/files.ts";
import { machineWsRoutes } from "./routes/machine-ws.ts";
import { templateRoutes } from "./routes/templates.ts";
import { webhookRoutes } from "./routes/webhooks.ts";
import { gitRoutes } from "./routes/git.ts";
import { codeRoutes } from "./routes/code.ts";
import { volumeRoutes } from "./routes/volumes.ts";
import { volumeWsRoutes } from "./routes/volume-ws.ts";
import { deploymentRoutes } from "./routes/deployments.ts";
import { snapshotRoutes } from "./routes/snapshots.ts";
import { createEdge, edgeRoutes } from "./routes/edge.ts";
import { isWebSocketUpgrade } from "../deployments/proxy.ts";
import type { ProxyLimits } from "../deployments/proxy.ts";
import type { EdgeDomain } from "../deployments/edge-origin.ts";
import type { IncomingMessage } from "node:http";
import type { Duplex } from "node:stream";
import { createServer } from "node:http";
import { e2bBoundOf, e2bCompat } from "../compat/e2b/index.ts";
import { consoleRoutes } from "../console/routes.ts";
import { createAuth, WS_BEARER_PREFIX, WS_PROTOCOL } from "./auth.ts";
import { mcpRoutes } from "../mcp/route.ts";
import { createMetrics } from "../metrics/registry.ts";
import { metricsRoutes } from "../metrics/route.ts";
import { hostRoutes } from "./routes/hosts.ts";
import { clusterSecret } from "../hosts/service.ts";
import { createClusterAuth } from "../hosts/cluster-auth.ts";
import { createForwarder } from "../hosts/forward.ts";
import { createPlacement } from "../hosts/placement.ts";
import { installClusterRouting } from "../hosts/routing.ts";
import { createTunnelClient, createTunnelServer, isTunnelUpgrade } from "../hosts/tunnel.ts";
import type { RemotePort } from "../hosts/tunnel.ts";
import { DEFAULT_PROXY_LIMITS } from "../deployments/proxy.ts";
import { BASE_TEMPLATE_REF } from "../templates/resolver.ts";

export type { App } from "./app-type.ts";

export interface ServerOptions {
  log: Logger;
  services: Services;
  bodyLimitBytes: number;
  wsPingIntervalMs: number;
  /** Per-watch bound of unsent volume watch frames (KILN_VOLUME_WATCH_QUEUE). */
  volumeWatchQueue?: number;
  /** KILN_MCP_HELD_MAX_MB in bytes: what MCP requests in flight may hold of Kiln's answers together. */
  mcpHeldMaxBytes?: number;
  /** Base of public edge URLs; an https one makes the edge cookie Secure. */
  publicUrl?: string;
  /** KILN_EDGE_DOMAIN: deployments' pages on origins of their own (`<label>.<domain>`). */
  edgeDomain?: EdgeDomain;
  /** Each service's (and sandbox port's) share and waits through the edge (KILN_EDGE_*). */
  edgeLimits?: ProxyLimits;
  /** Where the E2B compatibility layer keeps its token secret, and the public URL it reports as `domain`. */
  e2b?: { dataDir: string; publicUrl: string; buildRetentionS?: number };
  /** KILN_SHUTDOWN_GRACE_MS: how long close() waits for open requests and streams before closing their connections. */
  shutdownGraceMs?: number;
  /** Hosts sharing the store: forwarding of machine-bound requests and placement of creates (src/hosts/). */
  cluster?: { lostAfterS: number };
}

/**
 * What placement prefers for the template a create names: the hosts that already hold every layer of it (undefined:
 * no preference), and the key of warm machines made for it (`base`, or a hot template's artifact id).
 */
function localityOf(services: Services) {
  return async (ref: string | undefined): Promise<{ holders?: Set<string>; warm?: string }> => {
    const resolved = await services.templates.resolve(ref ?? BASE_TEMPLATE_REF).catch(() => undefined);
    if (!resolved) return {};
    const warm = resolved.template.canonical_ref === BASE_TEMPLATE_REF ? "base" : resolved.artifact.id;
    const content = services.layers?.travelling(resolved.artifact);
    return { holders: content ? await services.layers!.holdersOfAll(content) : undefined, warm };
  };
}

export async function buildServer(opts: ServerOptions): Promise<App> {
  // The public edge's HTTP requests are proxied before Fastify routes them: they are a data path, not API calls.
  const edge = createEdge({ services: opts.services, log: opts.log, secureCookies: opts.publicUrl?.startsWith("https:") ?? false, limits: opts.edgeLimits, edgeDomain: opts.edgeDomain });
  const metrics = createMetrics({ db: opts.services.store.db, warmPool: () => opts.services.pool.stats(), hotPools: () => opts.services.hotPools.stats().templates });
  const app = Fastify({
    serverFactory: (handler) => {
      // Kiln honours one upgrade, WebSocket (and, between hosts, its cluster tunnel, on its own route with cluster
      // headers): any other Upgrade header is served as the plain request it also is, never handed to an upgrade
      // listener (where the edge would make the connection a pipe).
      const server = createServer({ shouldUpgradeCallback: (req) => isWebSocketUpgrade(req) || isTunnelUpgrade(req) }, (req, res) => {
        if (edge.handleRequest(req, res)) metrics.observeEdge(res);
        else handler(req, res);
      });
      // What Fastify sets on a server it makes itself (its defaults).
      server.keepAliveTimeout = 72_000;
      server.requestTimeout = 0;
      server.setTimeout(0);
      return server;
    },
    loggerInstance: opts.log,
    genReqId: () => newId("req"),
    requestIdHeader: false,
    bodyLimit: opts.bodyLimitBytes,
    return503OnClosing: true,
    // One line per request, written when it is answered (see onResponse), instead of Fastify's two.
    logController: new LogController({ disableRequestLogging: true }),
    ajv: { customOptions: { removeAdditional: false, coerceTypes: "array", useDefaults: true, allErrors: false } },
    routerOptions: { ignoreTrailingSlash: true },
  }).withTypeProvider<TypeBoxTypeProvider>() as unknown as App;

  // Byte bodies (file uploads) reach their handler as a stream; the handler enforces its own limit. Bodies are JSON
  // or bytes: a text/plain body would reach a JSON route as a string, so it is refused (415, with a hint) instead.
  app.addContentTypeParser("application/octet-stream", (_req, payload, done) => done(null, payload));
  app.removeContentTypeParser("text/plain");

  // Authentication first: its onRoute check must see every route registered below (plugins' routes too).
  const auth = createAuth(opts.services.keys);
  auth.install(app);
  auth.provide("edge-token", (req) => edge.verifyUpgrade(req));
  /** Whether a machine runs on another host (then its requests are forwarded): MCP's direct calls ask it. */
  let machineElsewhere: ((id: string) => Promise<boolean>) | undefined;
  /** A port inside a machine of another host, through the cluster tunnel (the edge and E2B's port proxy). */
  let remotePort: RemotePort | undefined;
  const limits = opts.edgeLimits ?? DEFAULT_PROXY_LIMITS;
  if (opts.cluster) {
    // After authentication (its hook is installed first): the caller is known before anything is forwarded.
    const { hosts } = opts.services;
    const clusterAuth = createClusterAuth({ secret: await clusterSecret(opts.services.store.db), hostId: hosts.hostId });
    auth.provideCluster(clusterAuth.verify);
    const forwarder = createForwarder({ db: opts.services.store.db, hostId: hosts.hostId, auth: clusterAuth, log: opts.log, hosts: hosts.hosts });
    const placement = createPlacement({ db: opts.services.store.db, hostId: hosts.hostId, lostAfterS: opts.cluster.lostAfterS, hosts: hosts.hosts });
    installClusterRouting(app, { hostId: hosts.hostId, forwarder, placement, boundOf: opts.e2b ? e2bBoundOf : undefined, locality: localityOf(opts.services), ownStatus: hosts.ownStatus });
    machineElsewhere = async (id) => (await forwarder.ownerOf({ kind: "machines", id })) !== undefined;
    remotePort = createTunnelClient({ forwarder, auth: clusterAuth, connectTimeoutMs: limits.connectTimeoutMs }).open;
    opts.services.deployments.setRemotePort(remotePort);
    opts.services.layers?.connect(clusterAuth, hosts.hosts);
    opts.services.volumes.connectCluster({ auth: clusterAuth, hosts: hosts.hosts });
    opts.services.deployments.connectCluster({ auth: clusterAuth, hosts: hosts.hosts, candidates: () => placement.candidates(), hasPeers: hosts.hasPeers });
    app.addHook("onClose", async () => opts.services.layers?.close());
    app.addHook("onClose", async () => forwarder.close());
  }
  const stopRevocationWatch = await opts.services.keys.watchRevocations((err) => opts.log.warn({ err }, "the revocation poll failed: remembered keys are not trusted until it succeeds"));
  app.addHook("onClose", (_app, done) => {
    stopRevocationWatch();
    done();
  });

  await app.register(swagger, {
    openapi: {
      openapi: "3.1.0",
      info: { title: "Kiln", version: "0.1.0", license: { name: "Apache-2.0" } },
      components: { securitySchemes: { bearer: { type: "http", scheme: "bearer" } } },
      security: [{ bearer: [] }],
    },
    transform: documentUpgrades,
  });

  const routePatterns: { method: string; pattern: RegExp }[] = [];
  app.addHook("onRoute", (route) => {
    const methods = Array.isArray(route.method) ? route.method : [route.method];
    const pattern = new RegExp("^" + route.url.replace(/[.*+?^${}()|[\]\\]/g, "\\$&").replace(/:[A-Za-z_]+/g, "[^/]+") + "/?$");
    for (const m of methods) routePatterns.push({ method: m, pattern });
  });

  // While shutting down, keep closing connections that have gone idle (in-flight requests finish first), so
  // close() need not wait for keep-alive timeouts; past the grace, requests still open (streams that end only with
  // their client or their machine: build logs, envd process and watch streams) lose their connections, so a stop
  // is bounded. The machines keep running; a client reconnects to them on the next server.
  app.addHook("preClose", (done) => {
    const timer = setInterval(() => app.server.closeIdleConnections(), 50);
    const grace = setTimeout(() => {
      opts.log.info({ grace_ms: opts.shutdownGraceMs }, "closing the connections still open after the shutdown grace");
      app.server.closeAllConnections();
    }, opts.shutdownGraceMs ?? 5000);
    app.server.once("close", () => (clearInterval(timer), clearTimeout(grace)));
    done();
  });

  // One line per answered request; a refused WebSocket upgrade then ends its connection (it can never become a socket).
  app.addHook("onResponse", (req, reply, done) => {
    req.log.info({ method: req.method, url: scrubUrl(req.url), status: reply.statusCode, ms: Math.round(reply.elapsedTime * 100) / 100 }, "request");
    metrics.observeRequest(req.method, routeConfigOf(req).url ?? "unmatched", reply.statusCode, reply.elapsedTime / 1000);
    if (req.headers.upgrade && reply.statusCode >= 400) req.raw.socket?.destroy();
    done();
  });

  app.setErrorHandler((err, req, reply) => {
    const { status, body } = toEnvelope(withHint(err, req), req.id);
    // Refusals the caller can act on (4xx, and 503 `unavailable`: try again) are expected: info, not error.
    if (status >= 500 && !(err instanceof KilnError && err.code === "unavailable")) req.log.error({ err }, "request failed");
    else req.log.info({ code: body.code, status }, "request refused");
    if (status === 413) closeAfterReply(req, reply);
    return sendEnvelope(reply, status, body);
  });

  app.setNotFoundHandler((req, reply) => {
    const path = req.url.split("?")[0];
    const allowed = routePatterns.filter((r) => r.pattern.test(path)).map((r) => r.method);
    if (allowed.length > 0) {
      reply.header("allow", [...new Set(allowed)].join(", "));
      const { status, body } = toEnvelope(new KilnError("method_not_allowed", `${req.method} is not allowed on ${path}`), req.id);
      return sendEnvelope(reply, status, body);
    }
    const { status, body } = toEnvelope(new KilnError("not_found", `No route ${req.method} ${path}`), req.id);
    return sendEnvelope(reply, status, body);
  });

  await app.register(metricsRoutes, { metrics });
  await app.register(healthRoutes, { services: opts.services });
  await app.register(keyRoutes, { services: opts.services });
  await app.register(hostRoutes, { services: opts.services, tunnels: createTunnelServer({ machines: opts.services.machines, limits }) });
  await app.register(machineRoutes, { services: opts.services });
  await app.register(snapshotRoutes, { services: opts.services });
  await app.register(fileRoutes, { services: opts.services });
  await app.register(templateRoutes, { services: opts.services });
  await app.register(webhookRoutes, { services: opts.services });
  await app.register(gitRoutes, { services: opts.services });
  await app.register(codeRoutes, { services: opts.services });
  await app.register(deploymentRoutes, { services: opts.services });
  // Before @fastify/websocket: the edge splices WebSocket upgrades itself, byte for byte, instead of terminating them.
  await app.register(edgeRoutes, { edge });
  await app.register(websocket, { options: { maxPayload: 16 * 1024 * 1024, handleProtocols: selectProtocol } });
  auth.watchWebSockets(app);
  await app.register(machineWsRoutes, { services: opts.services, pingIntervalMs: opts.wsPingIntervalMs });
  await app.register(volumeRoutes, { services: opts.services });
  await app.register(volumeWsRoutes, { services: opts.services, pingIntervalMs: opts.wsPingIntervalMs, queueSize: opts.volumeWatchQueue ?? 4096 });
  await app.register(mcpRoutes, { heldMaxBytes: opts.mcpHeldMaxBytes, direct: { exec: opts.services.exec, elsewhere: machineElsewhere, observe: (m, route, status, s) => metrics.observeRequest(m, route, status, s) } });
  if (opts.e2b) await app.register(e2bCompat, { services: opts.services, auth, ...opts.e2b, limits: opts.edgeLimits, remotePort });

  // Public: client generators and browsers fetch it without a key.
  app.get("/v1/openapi.json", { config: { auth: "none" }, schema: { hide: true } }, async () => app.swagger());
  // The web console's static files (public: the page asks for a key and sends it only in headers).
  await app.register(consoleRoutes);
  takeEdgeHostUpgrades(app, edge);
  return app;
}

/**
 * WebSocket handshakes on an edge host (`<label>.<KILN_EDGE_DOMAIN>`) belong to the deployment, whatever their path:
 * they are taken before the upgrade listeners registered so far (Fastify's, the E2B port proxy's) see them.
 */
function takeEdgeHostUpgrades(app: App, edge: ReturnType<typeof createEdge>) {
  const previous = app.server.listeners("upgrade") as ((req: IncomingMessage, socket: Duplex, head: Buffer) => void)[];
  app.server.removeAllListeners("upgrade");
  app.server.on("upgrade", (req: IncomingMessage, socket: Duplex, head: Buffer) => {
    if (edge.isEdgeHost(req)) return void edge.handleHostUpgrade(req, socket, head);
    for (const l of previous) l(req, socket, head);
  });
}

/**
 * @fastify/websocket hides its routes from the document; Kiln lists them (GET /v1/machines/{id}/ws, /v1/volumes/{id}/ws)
 * with their 101 answer, so every documented path is in it and client generators see them.
 */
function documentUpgrades({ schema, url, route }: { schema: FastifySchema; url: string; route: RouteOptions }) {
  if (!(route as { websocket?: boolean }).websocket || !schema) return { schema, url };
  const response = (schema.response ?? {}) as Record<string, unknown>;
  const upgrade = {
    description: "Switching Protocols: the connection is now a WebSocket carrying JSON text frames (docs: DESIGN.md §5). Send `Connection: Upgrade`, `Upgrade: websocket`.",
    type: "null",
  };
  return { schema: { ...schema, hide: false, response: { 101: upgrade, ...response } } as FastifySchema, url };
}

/**
 * A body refused part-way leaves unread bytes on the connection: say `connection: close`, end our side once the
 * answer is out, drop whatever the client still sends, and destroy the socket soon after, so nothing half-read
 * outlives the request (a server close would otherwise wait on it).
 */
function closeAfterReply(req: FastifyRequest, reply: FastifyReply) {
  reply.header("connection", "close");
  // A body stream the handler destroyed (an upload refused while it streamed) has let go of its socket: the
  // response still holds it. With neither, the client is gone and there is nothing left to close.
  const socket = req.raw.socket ?? reply.raw.socket;
  if (!socket || socket.destroyed) return;
  reply.raw.once("finish", () => {
    socket.end();
    socket.resume();
    setTimeout(() => socket.destroy(), 1000).unref();
  });
}

/**
 * The subprotocol a WebSocket answers with: `kiln.v1` when offered (a browser that authenticated with subprotocols,
 * auth.ts), else the first one offered as ws does by default — never a `kiln.bearer.` one, which carries a key.
 */
function selectProtocol(offered: Set<string>): string | false {
  if (offered.has(WS_PROTOCOL)) return WS_PROTOCOL;
  for (const p of offered) if (!p.startsWith(WS_BEARER_PREFIX)) return p;
  return false;
}

/** Fastify's bare "Unsupported Media Type" (what `curl -d` gets: form encoding) says what to send instead. */
function withHint(err: unknown, req: FastifyRequest): unknown {
  if ((err as { code?: string })?.code !== "FST_ERR_CTP_INVALID_MEDIA_TYPE") return err;
  const sent = String(req.headers["content-type"] ?? "none").slice(0, 100);
  return new KilnError("unsupported_media_type", `Content-Type ${JSON.stringify(sent)} is not accepted here: send Content-Type: application/json (file and blob uploads: application/octet-stream)`);
}

function sendEnvelope(reply: FastifyReply, status: number, body: unknown) {
  return reply.code(status).type("application/json; charset=utf-8").send(body);
}
