// The public edge: /edge/<service_id>/… proxies HTTP and WebSocket to a ready service, authorised by the signed
// edge_token of its public URL (then by an HttpOnly cookie scoped to the service's path), never by an API key.

import type { FastifyReply, FastifyRequest } from "fastify";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { KilnError, toEnvelope } from "../../errors.ts";
import { scrubUrl } from "../../log.ts";
import { createEdgeProxy, forwardedHeaders, returnedHeaders } from "../../deployments/proxy.ts";

/** The cookie that carries the edge token after the first request, so a browser's relative requests work too. */
export const EDGE_COOKIE = "kiln_edge";
const METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

function cookieValue(header: string | undefined, name: string): string | undefined {
  if (!header) return undefined;
  for (const part of header.split(";")) {
    const [k, ...v] = part.trim().split("=");
    if (k === name) return v.join("=");
  }
  return undefined;
}

/** The head buffer @fastify/websocket kept for an upgrade request (empty for every normal client). */
function upgradeHead(req: FastifyRequest): Buffer {
  const raw = req.raw as unknown as Record<symbol, unknown>;
  const sym = Object.getOwnPropertySymbols(raw).find((s) => s.description === "ws-head");
  const head = sym ? raw[sym] : undefined;
  return Buffer.isBuffer(head) ? head : Buffer.alloc(0);
}

export async function edgeRoutes(app: App, opts: { services: Services; secureCookies: boolean }) {
  const { deployments } = opts.services;
  const proxy = createEdgeProxy((id) => deployments.openServicePort(id));
  deployments.setProxy(proxy);
  app.addHook("onClose", (_app, done) => {
    proxy.close();
    done();
  });

  // Bodies are the service's business: they pass through as streams, never parsed or buffered here.
  app.removeAllContentTypeParsers();
  app.addContentTypeParser("*", (_req, _payload, done) => done(null, undefined));

  async function handle(req: FastifyRequest<{ Params: { service_id: string; "*"?: string } }>, reply: FastifyReply) {
    const serviceId = req.params.service_id;
    // The raw target is forwarded as the client wrote it (no re-encoding or dot-segment folding): only the
    // /edge/<id> prefix and the edge_token parameter come off.
    const q = req.url.indexOf("?");
    const rawPath = q < 0 ? req.url : req.url.slice(0, q);
    const params = q < 0 ? [] : req.url.slice(q + 1).split("&");
    const slash = rawPath.indexOf("/", "/edge/".length);
    const prefix = `/edge/${serviceId}`;
    if (slash < 0) {
      // Relative links resolve against the directory: send /edge/<id> to /edge/<id>/ (the token stays in the query).
      return reply.code(308).header("location", `${rawPath}/${q < 0 ? "" : req.url.slice(q)}`).send();
    }
    const tokenParam = params.find((p) => p.startsWith("edge_token="));
    // Tokens are URL-safe as issued, so the parameter is compared as written (nothing to decode, nothing to throw).
    const queryToken = tokenParam === undefined ? undefined : tokenParam.slice("edge_token=".length);
    const token = queryToken ?? cookieValue(req.headers.cookie, EDGE_COOKIE);
    const expiresAtMs = deployments.authorizeEdge(serviceId, token);
    if (!deployments.isRoutable(serviceId)) throw new KilnError("unavailable", `Service ${serviceId} is not running`, { detail: { retryable: true } });

    const kept = params.filter((p) => !p.startsWith("edge_token="));
    const path = rawPath.slice(slash) + (kept.length ? `?${kept.join("&")}` : "");
    const upgrading = typeof req.headers.upgrade === "string";
    const headers = forwardedHeaders(req.headers, { stripCookie: EDGE_COOKIE, clientIp: req.ip, proto: opts.secureCookies ? "https" : "http", keepUpgrade: upgrading });

    if (upgrading) {
      reply.hijack();
      const socket = req.raw.socket;
      try {
        await proxy.upgrade(serviceId, { method: req.method, path, headers: headers as Record<string, string> }, socket, upgradeHead(req));
        req.log.info({ method: req.method, url: scrubUrl(req.url), status: 101, service_id: serviceId }, "edge upgrade");
      } catch (err) {
        req.log.info({ err, service_id: serviceId, url: scrubUrl(req.url) }, "edge upgrade failed");
        socket.end("HTTP/1.1 502 Bad Gateway\r\nconnection: close\r\ncontent-length: 0\r\n\r\n");
      }
      return;
    }

    // The answer streams straight from the service to the socket; the access line is written here (hijacked
    // replies skip the server's onResponse hook), with the token scrubbed from the URL like every other line.
    reply.hijack();
    const cookie = queryToken
      ? // Later relative requests from a browser carry the token as a cookie scoped to this service's path.
        [`${EDGE_COOKIE}=${queryToken}; Path=${prefix}/; Max-Age=${Math.max(0, Math.floor((expiresAtMs - Date.now()) / 1000))}; HttpOnly; SameSite=Lax${opts.secureCookies ? "; Secure" : ""}`]
      : undefined;
    const started = performance.now();
    let status: number;
    try {
      status = await proxy.forward(
        serviceId,
        { method: req.method, path, headers, body: req.method === "GET" || req.method === "HEAD" ? undefined : req.raw },
        reply.raw,
        () => ({ "x-request-id": [req.id], ...(cookie ? { "set-cookie": cookie } : {}) }),
      );
    } catch (err) {
      const { status: code, body } = toEnvelope(
        err instanceof KilnError ? err : new KilnError("unavailable", `Service ${serviceId} did not answer`, { detail: { retryable: true } }),
        req.id,
      );
      if (!reply.raw.headersSent) reply.raw.writeHead(code, { "content-type": "application/json; charset=utf-8", "x-request-id": req.id }).end(JSON.stringify(body));
      status = code;
    }
    req.log.info({ method: req.method, url: scrubUrl(req.url), status, ms: Math.round((performance.now() - started) * 100) / 100, service_id: serviceId }, "request");
  }

  const schema = { hide: true };
  app.route({ method: METHODS, url: "/edge/:service_id", schema, handler: handle });
  app.route({ method: METHODS, url: "/edge/:service_id/*", schema, handler: handle });
}
