// The public edge: /edge/<service_id>/… (one replica) and /edge/<deployment_id>/… (any ready replica) proxy HTTP and
// WebSocket to a service, authorised as the deployment's access says — its long-lived token, nothing (public), or a
// signed expiring token — carried by the URL's edge_token (then by an HttpOnly cookie scoped to that path), never
// by an API key.
// Plain HTTP requests are served before Fastify routes them (see server.ts: they are the data path, and Fastify's
// request machinery cost more than the proxying); WebSocket upgrades come through the Fastify route below.

import type { IncomingMessage, ServerResponse } from "node:http";
import type { FastifyReply, FastifyRequest } from "fastify";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { KilnError, toEnvelope } from "../../errors.ts";
import { newId } from "../../store/ids.ts";
import { scrubUrl } from "../../log.ts";
import type { Logger } from "../../log.ts";
import { acceptWebSocket, createUpstreamProxy, DEFAULT_PROXY_LIMITS, forwardedHeaders, isWebSocketUpgrade } from "../../deployments/proxy.ts";
import type { ProxyLimits } from "../../deployments/proxy.ts";
import type { EdgeGrant } from "../../deployments/edge.ts";
import { mayCarryKilnCredentials, rememberedCheck, stripKilnCredentials } from "../../deployments/credentials.ts";

/** The cookie that carries the edge token after the first request, so a browser's relative requests work too. */
export const EDGE_COOKIE = "kiln_edge";
const METHODS = new Set(["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]);
const PREFIX = "/edge/";

function cookieValue(header: string | undefined, name: string): string | undefined {
  if (!header) return undefined;
  for (const part of header.split(";")) {
    const [k, ...v] = part.trim().split("=");
    if (k === name) return v.join("=");
  }
  return undefined;
}

/** [A-Za-z0-9_-]{1,64}, checked by hand: this runs on every proxied request. */
function isId(s: string): boolean {
  if (s.length === 0 || s.length > 64) return false;
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (!((c >= 48 && c <= 57) || (c >= 65 && c <= 90) || (c >= 97 && c <= 122) || c === 95 || c === 45)) return false;
  }
  return true;
}

/** Where an /edge request goes: the service, the target as the service sees it, and the token it carried. */
export type EdgeTarget = { redirect: string } | { serviceId: string; path: string; queryToken: string | undefined };

/**
 * Splits a raw request target. The target is forwarded as the client wrote it (no re-encoding, no dot-segment
 * folding): only the /edge/<id> prefix and the edge_token parameter come off. Tokens are URL-safe as issued, so the
 * parameter is taken as written (nothing to decode, nothing to throw on).
 */
export function edgeTarget(url: string): EdgeTarget | undefined {
  const q = url.indexOf("?");
  const rawPath = q < 0 ? url : url.slice(0, q);
  if (!rawPath.startsWith(PREFIX)) return undefined;
  const slash = rawPath.indexOf("/", PREFIX.length);
  const serviceId = rawPath.slice(PREFIX.length, slash < 0 ? undefined : slash);
  if (!isId(serviceId)) return undefined;
  // Relative links resolve against the directory: /edge/<id> goes to /edge/<id>/ (the query, token too, stays).
  if (slash < 0) return { redirect: `${rawPath}/${q < 0 ? "" : url.slice(q)}` };
  const params = q < 0 ? [] : url.slice(q + 1).split("&");
  const tokenParam = params.find((p) => p.startsWith("edge_token="));
  const kept = params.filter((p) => !p.startsWith("edge_token="));
  return {
    serviceId,
    path: rawPath.slice(slash) + (kept.length ? `?${kept.join("&")}` : ""),
    queryToken: tokenParam === undefined ? undefined : tokenParam.slice("edge_token=".length),
  };
}

export function createEdge(opts: { services: Services; log: Logger; secureCookies: boolean; limits?: ProxyLimits }) {
  const { deployments } = opts.services;
  const proxy = createUpstreamProxy((id) => deployments.openServicePort(id), opts.limits ?? DEFAULT_PROXY_LIMITS);
  deployments.setProxy(proxy);
  // A Kiln API key sent along (a client that adds its key to every request to Kiln's host) never reaches a service.
  const isKilnKey = rememberedCheck((c) => opts.services.keys.isKey(c));

  /** Authorises the request for `id` (a service's or a deployment's); answers the grant. Throws 401/503 as KilnErrors. */
  function authorize(id: string, queryToken: string | undefined, cookie: string | undefined): EdgeGrant {
    const grant = deployments.authorizeEdge(id, queryToken ?? cookieValue(cookie, EDGE_COOKIE));
    if (!deployments.isRoutable(grant.serviceId)) throw new KilnError("unavailable", `Service ${grant.serviceId} is not running`, { detail: { retryable: true } });
    return grant;
  }

  /** The cookie a browser keeps the URL's token in: until a signed one expires, for the session for a long-lived one. */
  function edgeCookie(id: string, token: string | undefined, grant: EdgeGrant): string[] | undefined {
    if (!token || grant.mode === "public") return undefined;
    const maxAge = grant.expiresAtMs === undefined ? "" : `; Max-Age=${Math.max(0, Math.floor((grant.expiresAtMs - Date.now()) / 1000))}`;
    return [`${EDGE_COOKIE}=${token}; Path=${PREFIX}${id}/${maxAge}; HttpOnly; SameSite=Lax${opts.secureCookies ? "; Secure" : ""}`];
  }

  /** WebSockets opened through a deployment's access, cut when that access changes (rotated, revoked, deleted). */
  const pipes = new Map<string, Set<{ destroy(): void }>>();
  deployments.onAccessChanged((deploymentId) => {
    const held = pipes.get(deploymentId);
    pipes.delete(deploymentId);
    for (const p of held ?? []) p.destroy();
  });
  function holdPipe(deploymentId: string | undefined, socket: { destroy(): void; once(e: "close", f: () => void): unknown }) {
    if (!deploymentId) return;
    let held = pipes.get(deploymentId);
    if (!held) pipes.set(deploymentId, (held = new Set()));
    held.add(socket);
    socket.once("close", () => {
      held.delete(socket);
      if (held.size === 0 && pipes.get(deploymentId) === held) pipes.delete(deploymentId);
    });
  }

  function sendError(res: ServerResponse, requestId: string, err: unknown): number {
    const { status, body } = toEnvelope(err, requestId);
    if (!res.headersSent) res.writeHead(status, { "content-type": "application/json; charset=utf-8", "x-request-id": requestId }).end(JSON.stringify(body));
    else res.destroy();
    return status;
  }

  async function serve(req: IncomingMessage, res: ServerResponse, requestId: string, target: Exclude<EdgeTarget, { redirect: string }>): Promise<number> {
    if (!METHODS.has(req.method ?? "")) throw new KilnError("method_not_allowed", `${req.method} is not allowed on the edge`);
    const grant = authorize(target.serviceId, target.queryToken, req.headers.cookie);
    const headers = forwardedHeaders(req.headers, { stripCookie: EDGE_COOKIE, clientIp: req.socket.remoteAddress, proto: opts.secureCookies ? "https" : "http", keepUpgrade: false });
    if (mayCarryKilnCredentials(headers)) await stripKilnCredentials(headers, isKilnKey);
    // Later relative requests from a browser carry the token as a cookie scoped to this URL's path.
    const cookie = edgeCookie(target.serviceId, target.queryToken, grant);
    try {
      return await proxy.forward(
        grant.serviceId,
        { method: req.method!, path: target.path, headers, body: req.method === "GET" || req.method === "HEAD" ? undefined : req },
        res,
        () => ({ "x-request-id": [requestId], ...(cookie ? { "set-cookie": cookie } : {}) }),
      );
    } catch (err) {
      throw err instanceof KilnError ? err : new KilnError("unavailable", `Service ${grant.serviceId} did not answer`, { detail: { retryable: true } });
    }
  }

  /**
   * The HTTP data path, called by the server for every request before Fastify sees it: answers true when the
   * request was an /edge one (and is being served), false to let Fastify route it. Writes its own access line,
   * with the token scrubbed from the URL like every other line.
   */
  function handleRequest(req: IncomingMessage, res: ServerResponse): boolean {
    const target = edgeTarget(req.url ?? "");
    if (!target) return false;
    const requestId = newId("req");
    const started = performance.now();
    const done = (status: number) =>
      opts.log.info({ reqId: requestId, method: req.method, url: scrubUrl(req.url ?? ""), status, ms: Math.round((performance.now() - started) * 100) / 100 }, "request");
    if ("redirect" in target) {
      res.writeHead(308, { location: target.redirect, "x-request-id": requestId, "content-length": "0" }).end();
      done(308);
      return true;
    }
    serve(req, res, requestId, target).then(done, (err: unknown) => {
      req.resume(); // an unread body must not hold the connection
      done(sendError(res, requestId, err));
    });
    return true;
  }

  /**
   * The `edge-token` check of the Fastify edge route, run by the server's auth hook before the handler: the raw
   * target must be an /edge/<id>/… one (as handleRequest reads it) and carry that service's token.
   */
  function verifyUpgrade(req: FastifyRequest): undefined {
    const target = edgeTarget(req.url);
    if (!target || "redirect" in target) throw new KilnError("unauthorized", "The edge needs /edge/<service_id>/… with its edge_token", { detail: { code: "unauthorized", phase: "auth" } });
    authorize(target.serviceId, target.queryToken, req.headers.cookie);
    return undefined;
  }

  /**
   * WebSocket upgrades (through Fastify and @fastify/websocket's upgrade hand-off). Only a WebSocket handshake is
   * honoured (the server hands every other Upgrade to handleRequest as a plain request), and only the service's
   * 101 to it makes a pipe; the pipe closes when the token that opened it expires.
   */
  async function handleUpgrade(req: FastifyRequest, reply: FastifyReply) {
    const target = edgeTarget(req.url);
    if (!target || "redirect" in target) throw new KilnError("not_found", "WebSocket upgrades need /edge/<service_id>/…");
    if (!isWebSocketUpgrade(req.raw)) throw new KilnError("invalid_request", "The edge upgrades only to WebSocket");
    const grant = authorize(target.serviceId, target.queryToken, req.headers.cookie);
    const headers = forwardedHeaders(req.headers, { stripCookie: EDGE_COOKIE, clientIp: req.ip, proto: opts.secureCookies ? "https" : "http", keepUpgrade: true });
    if (mayCarryKilnCredentials(headers)) await stripKilnCredentials(headers, isKilnKey);
    reply.hijack();
    const socket = req.raw.socket;
    holdPipe(grant.deploymentId, socket);
    try {
      const status = await proxy.upgrade(grant.serviceId, { method: req.method, path: target.path, headers }, socket, upgradeHead(req), { accept: acceptWebSocket, until: grant.expiresAtMs });
      req.log.info({ method: req.method, url: scrubUrl(req.url), status }, "request");
    } catch (err) {
      const status = err instanceof KilnError ? (err.code === "timeout" ? 504 : err.code === "unavailable" && err.detail?.retryable ? 503 : 502) : 502;
      req.log.info({ err, url: scrubUrl(req.url), status }, "edge upgrade failed");
      socket.end(`HTTP/1.1 ${status} ${status === 504 ? "Gateway Timeout" : status === 503 ? "Service Unavailable" : "Bad Gateway"}\r\nconnection: close\r\ncontent-length: 0\r\n\r\n`);
    }
  }

  return { handleRequest, handleUpgrade, verifyUpgrade, close: () => proxy.close() };
}

export type Edge = ReturnType<typeof createEdge>;

/** The head buffer @fastify/websocket kept for an upgrade request (empty for every normal client). */
function upgradeHead(req: FastifyRequest): Buffer {
  const raw = req.raw as unknown as Record<symbol, unknown>;
  const sym = Object.getOwnPropertySymbols(raw).find((s) => s.description === "ws-head");
  const head = sym ? raw[sym] : undefined;
  return Buffer.isBuffer(head) ? head : Buffer.alloc(0);
}

/** The Fastify side of the edge: WebSocket upgrades (plain requests never get here, see handleRequest). */
export async function edgeRoutes(app: App, opts: { edge: Edge }) {
  app.addHook("onClose", (_app, done) => {
    opts.edge.close();
    done();
  });
  // Authenticated by the service's edge token (server.ts gives edge.verifyUpgrade for `edge-token`), never a key.
  const route = { config: { auth: "edge-token" as const }, schema: { hide: true }, handler: (req: FastifyRequest, reply: FastifyReply) => opts.edge.handleUpgrade(req, reply) };
  app.route({ method: "GET", url: "/edge/:service_id", ...route });
  app.route({ method: "GET", url: "/edge/:service_id/*", ...route });
}
