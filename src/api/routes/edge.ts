// The public edge: /edge/<service_id>/… (one replica) and /edge/<deployment_id>/… (any ready replica) proxy HTTP and
// WebSocket to a service — or, with KILN_EDGE_DOMAIN, the Host `<label>.<edge domain>` at `/` (an origin per
// deployment; src/deployments/edge-origin.ts; the path form, on Kiln's origin, is sandboxed). A request is authorised
// as the deployment's access says — its long-lived token, nothing (public), or a signed expiring token — carried by
// the URL's edge_token (then by an HttpOnly cookie scoped to that path or host), never by an API key.
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
import { confinePathCookies, hostOnlyCookies, idOfEdgeHost, PATH_EDGE_SANDBOX } from "../../deployments/edge-origin.ts";
import type { EdgeDomain } from "../../deployments/edge-origin.ts";
import type { OutgoingHttpHeaders } from "node:http";
import type { Duplex } from "node:stream";

/** The cookie that carries the edge token after the first request, so a browser's relative requests work too. */
export const EDGE_COOKIE = "kiln_edge";
const METHODS = new Set(["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]);
const PREFIX = "/edge/";

/** Every value of a cookie the request carries (at most 8): a page may have planted a decoy beside the real one. */
function cookieValues(header: string | undefined, name: string): string[] {
  const out: string[] = [];
  if (!header) return out;
  for (const part of header.split(";")) {
    const [k, ...v] = part.trim().split("=");
    if (k === name && out.length < 8) out.push(v.join("="));
  }
  return out;
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

/**
 * Where an edge request goes: the service (or deployment) id, the target as the service sees it, the token it
 * carried, and its form — `path` (/edge/<id>/… on Kiln's origin, sandboxed) or `host` (an origin of its own).
 */
export type EdgeTarget = { redirect: string } | { serviceId: string; path: string; queryToken: string | undefined; form: "path" | "host" };

/** A raw path and query without its edge_token parameter (taken as written: tokens are URL-safe as issued). */
function withoutToken(rawPath: string, query: string | undefined): { path: string; queryToken: string | undefined } {
  const params = query === undefined ? [] : query.split("&");
  const tokenParam = params.find((p) => p.startsWith("edge_token="));
  const kept = params.filter((p) => !p.startsWith("edge_token="));
  return { path: rawPath + (kept.length ? `?${kept.join("&")}` : ""), queryToken: tokenParam === undefined ? undefined : tokenParam.slice("edge_token=".length) };
}

/** A request on an edge host (`<label>.<edge domain>`): the whole origin-form target is the service's. */
export function hostTarget(url: string, host: string | undefined, domain: EdgeDomain | undefined): EdgeTarget | undefined {
  const id = domain ? idOfEdgeHost(host, domain) : undefined;
  if (!id) return undefined;
  const q = url.indexOf("?");
  const rawPath = q < 0 ? url : url.slice(0, q);
  return { serviceId: id, form: "host", ...withoutToken(rawPath.startsWith("/") ? rawPath : "/", q < 0 ? undefined : url.slice(q + 1)) };
}

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
  return { serviceId, form: "path", ...withoutToken(rawPath.slice(slash), q < 0 ? undefined : url.slice(q + 1)) };
}

export function createEdge(opts: { services: Services; log: Logger; secureCookies: boolean; limits?: ProxyLimits; edgeDomain?: EdgeDomain }) {
  const { deployments } = opts.services;
  const proxy = createUpstreamProxy((id, use) => deployments.openServicePort(id, use), opts.limits ?? DEFAULT_PROXY_LIMITS);
  deployments.setProxy(proxy);
  // A Kiln API key sent along (a client that adds its key to every request to Kiln's host) never reaches a service.
  const isKilnKey = rememberedCheck((c) => opts.services.keys.isKey(c));

  /** Authorises the request for `id` (a service's or a deployment's); answers the grant. Throws 401/503 as KilnErrors. */
  function authorize(id: string, queryToken: string | undefined, cookie: string | undefined): EdgeGrant {
    const grant = queryToken !== undefined ? deployments.authorizeEdge(id, queryToken) : authorizeByCookie(id, cookieValues(cookie, EDGE_COOKIE));
    if (!deployments.isRoutable(grant.serviceId)) throw new KilnError("unavailable", `Service ${grant.serviceId} is not running`, { detail: { retryable: true } });
    return grant;
  }

  /** The first of the request's edge cookies that passes (a decoy planted beside the real one changes nothing). */
  function authorizeByCookie(id: string, values: string[]): EdgeGrant {
    let refused: unknown;
    for (const v of values) {
      try {
        return deployments.authorizeEdge(id, v);
      } catch (err) {
        refused ??= err;
      }
    }
    if (refused !== undefined) throw refused;
    return deployments.authorizeEdge(id, undefined);
  }

  /**
   * The cookie a browser keeps the URL's token in: until a signed one expires, for the session for a long-lived one.
   * On an edge host it is host-only with Path=/ (the origin is the deployment's); on the path form, scoped to the path.
   */
  function edgeCookie(target: { serviceId: string; form: "path" | "host" }, token: string | undefined, grant: EdgeGrant): string[] | undefined {
    if (!token || grant.mode === "public") return undefined;
    const maxAge = grant.expiresAtMs === undefined ? "" : `; Max-Age=${Math.max(0, Math.floor((grant.expiresAtMs - Date.now()) / 1000))}`;
    const path = target.form === "host" ? "/" : `${PREFIX}${target.serviceId}/`;
    return [`${EDGE_COOKIE}=${token}; Path=${path}${maxAge}; HttpOnly; SameSite=Lax${opts.secureCookies ? "; Secure" : ""}`];
  }

  /**
   * What the edge adds to (or takes from) a service's answer head. Path form: the sandbox CSP beside any the service
   * sent, and its cookies confined to its prefix. Host form: its cookies host-only.
   */
  function shapeHead(target: { serviceId: string; form: "path" | "host" }, out: OutgoingHttpHeaders): void {
    if (target.form === "host") {
      const cookies = hostOnlyCookies(out["set-cookie"], EDGE_COOKIE);
      if (cookies) out["set-cookie"] = cookies;
      else delete out["set-cookie"];
      return;
    }
    const cookies = confinePathCookies(out["set-cookie"], target.serviceId, EDGE_COOKIE);
    if (cookies) out["set-cookie"] = cookies;
    else delete out["set-cookie"];
    const csp = out["content-security-policy"];
    // Comma-separated policies are separate policies (CSP3 §3.1): each is enforced, the sandbox whatever the others say.
    out["content-security-policy"] = csp === undefined ? PATH_EDGE_SANDBOX : `${Array.isArray(csp) ? csp.join(", ") : String(csp)}, ${PATH_EDGE_SANDBOX}`;
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

  function sendError(res: ServerResponse, requestId: string, err: unknown, form: "path" | "host"): number {
    const { status, body } = toEnvelope(err, requestId);
    const sandbox: Record<string, string> = form === "path" ? { "content-security-policy": PATH_EDGE_SANDBOX } : {};
    if (!res.headersSent) res.writeHead(status, { "content-type": "application/json; charset=utf-8", "x-request-id": requestId, ...sandbox }).end(JSON.stringify(body));
    else res.destroy();
    return status;
  }

  async function serve(req: IncomingMessage, res: ServerResponse, requestId: string, target: Exclude<EdgeTarget, { redirect: string }>): Promise<number> {
    if (!METHODS.has(req.method ?? "")) throw new KilnError("method_not_allowed", `${req.method} is not allowed on the edge`);
    const grant = authorize(target.serviceId, target.queryToken, req.headers.cookie);
    const headers = forwardedHeaders(req.headers, { stripCookie: EDGE_COOKIE, clientIp: req.socket.remoteAddress, proto: opts.secureCookies ? "https" : "http", keepUpgrade: false });
    if (mayCarryKilnCredentials(headers)) await stripKilnCredentials(headers, isKilnKey);
    // Later relative requests from a browser carry the token as a cookie scoped to this URL's path.
    const cookie = edgeCookie(target, target.queryToken, grant);
    try {
      return await proxy.forward(
        grant.serviceId,
        { method: req.method!, path: target.path, headers, body: req.method === "GET" || req.method === "HEAD" ? undefined : req },
        res,
        (_status, out) => {
          shapeHead(target, out);
          return { "x-request-id": [requestId], ...(cookie ? { "set-cookie": cookie } : {}) };
        },
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
    // An edge host is the deployment's whole origin: nothing of Kiln's API or console is served there.
    const target = hostTarget(req.url ?? "", req.headers.host, opts.edgeDomain) ?? edgeTarget(req.url ?? "");
    if (!target) return false;
    const requestId = newId("req");
    const started = performance.now();
    const done = (status: number) =>
      opts.log.info({ reqId: requestId, method: req.method, url: scrubUrl(req.url ?? ""), status, ms: Math.round((performance.now() - started) * 100) / 100 }, "request");
    if ("redirect" in target) {
      res.writeHead(308, { location: target.redirect, "x-request-id": requestId, "content-length": "0", "content-security-policy": PATH_EDGE_SANDBOX }).end();
      done(308);
      return true;
    }
    serve(req, res, requestId, target).then(done, (err: unknown) => {
      req.resume(); // an unread body must not hold the connection
      done(sendError(res, requestId, err, target.form));
    });
    return true;
  }

  /** Whether an upgrade request is for an edge host (handleHostUpgrade takes it before Fastify's listener). */
  function isEdgeHost(req: IncomingMessage): boolean {
    return !!opts.edgeDomain && idOfEdgeHost(req.headers.host, opts.edgeDomain) !== undefined;
  }

  /** A WebSocket handshake on an edge host: authorised and spliced as on the path form; a refusal ends the connection. */
  async function handleHostUpgrade(req: IncomingMessage, socket: Duplex, head: Buffer): Promise<void> {
    socket.on("error", () => undefined);
    let status = 101;
    try {
      const target = hostTarget(req.url ?? "", req.headers.host, opts.edgeDomain);
      if (!target || "redirect" in target) throw new KilnError("not_found", "not an edge host");
      if (!isWebSocketUpgrade(req)) throw new KilnError("invalid_request", "The edge upgrades only to WebSocket");
      const grant = authorize(target.serviceId, target.queryToken, req.headers.cookie);
      const headers = forwardedHeaders(req.headers, { stripCookie: EDGE_COOKIE, clientIp: req.socket.remoteAddress, proto: opts.secureCookies ? "https" : "http", keepUpgrade: true });
      if (mayCarryKilnCredentials(headers)) await stripKilnCredentials(headers, isKilnKey);
      holdPipe(grant.deploymentId, socket);
      status = await proxy.upgrade(grant.serviceId, { method: req.method ?? "GET", path: target.path, headers }, socket, head, { accept: acceptWebSocket, until: grant.expiresAtMs });
    } catch (err) {
      status = err instanceof KilnError ? (err.code === "timeout" ? 504 : err.code === "unavailable" ? (err.detail?.retryable ? 503 : 502) : err.status) : 502;
      socket.end(`HTTP/1.1 ${status} Refused\r\nconnection: close\r\ncontent-length: 0\r\n\r\n`);
    }
    opts.log.info({ method: req.method, url: scrubUrl(req.url ?? ""), host: req.headers.host, status }, "request");
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

  return { handleRequest, handleUpgrade, verifyUpgrade, isEdgeHost, handleHostUpgrade, close: () => proxy.close() };
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
