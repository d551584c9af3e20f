// The edge data path: HTTP requests and WebSocket upgrades forwarded to a service's port through the guest agent's
// port tunnel. Bodies stream both ways (nothing is buffered whole); tunnels are kept alive per service and reused.

import { Pool } from "undici";
import type { Dispatcher } from "undici";
import type { IncomingHttpHeaders, IncomingMessage, OutgoingHttpHeaders, ServerResponse } from "node:http";
import type { Duplex } from "node:stream";
import type { Socket } from "node:net";

/** Headers that belong to one hop and never cross the proxy. */
const HOP_BY_HOP = new Set(["connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"]);

export interface ForwardRequest {
  method: string;
  /** Path and query as the service should see them (the /edge/<id> prefix and the token removed). */
  path: string;
  headers: OutgoingHttpHeaders;
  body: IncomingMessage | undefined;
}

export function createEdgeProxy(open: (serviceId: string) => Promise<Socket>) {
  // undici pools whose connections are tunnels into the machine: kept alive and reused across requests.
  const pools = new Map<string, Pool>();

  function poolFor(serviceId: string): Pool {
    let pool = pools.get(serviceId);
    if (!pool) {
      pool = new Pool("http://service", {
        connections: 64,
        pipelining: 1,
        keepAliveTimeout: 30_000,
        headersTimeout: 0,
        bodyTimeout: 0,
        connect: (_opts, callback) => {
          open(serviceId).then(
            (socket) => callback(null, socket),
            (err: Error) => callback(err, null),
          );
        },
      });
      pools.set(serviceId, pool);
    }
    return pool;
  }

  /**
   * Sends the request and writes the service's answer to `res` as it arrives, pausing the service whenever the
   * client is slower. Rejects before any byte is written when the service cannot be reached; `headOf` adds
   * headers (the edge cookie) to the response head.
   */
  function forward(serviceId: string, req: ForwardRequest, res: ServerResponse, headOf: (status: number) => Record<string, string[]>): Promise<number> {
    return new Promise((resolve, reject) => {
      let status = 0;
      const handler: Dispatcher.DispatchHandler = {
        onRequestStart(controller) {
          res.once("close", () => {
            if (!res.writableFinished) controller.abort(new Error("the client went away"));
          });
        },
        onResponseStart(controller, statusCode, headers) {
          status = statusCode;
          if (statusCode < 200) return; // 1xx informational answers are not relayed
          const out = returnedHeaders(headers as IncomingHttpHeaders);
          for (const [k, v] of Object.entries(headOf(statusCode))) {
            const prev = out[k];
            out[k] = prev === undefined ? v : [...(Array.isArray(prev) ? prev : [String(prev)]), ...v];
          }
          res.writeHead(statusCode, out);
          res.on("drain", () => controller.resume());
        },
        onResponseData(controller, chunk) {
          if (!res.write(chunk)) controller.pause();
        },
        onResponseEnd() {
          res.end();
          resolve(status);
        },
        onResponseError(_controller, err) {
          if (res.headersSent) {
            res.destroy(err);
            resolve(status);
          } else reject(err);
        },
      };
      poolFor(serviceId).dispatch(
        { method: req.method as Dispatcher.HttpMethod, path: req.path, headers: req.headers as Record<string, string | string[]>, body: req.body ?? null },
        handler,
      );
    });
  }

  /** Opens a fresh tunnel, replays the upgrade request on it and splices the two sockets together. */
  async function upgrade(serviceId: string, req: { method: string; path: string; headers: IncomingHttpHeaders }, client: Duplex, head: Buffer): Promise<void> {
    const upstream = await open(serviceId);
    let text = `${req.method} ${req.path} HTTP/1.1\r\n`;
    for (const [name, value] of Object.entries(req.headers)) {
      if (value === undefined) continue;
      for (const v of Array.isArray(value) ? value : [value]) text += `${name}: ${v}\r\n`;
    }
    upstream.write(text + "\r\n");
    if (head.length) upstream.write(head);
    upstream.pipe(client);
    client.pipe(upstream);
    const end = () => {
      upstream.destroy();
      client.destroy();
    };
    upstream.once("close", end);
    client.once("close", end);
    upstream.on("error", end);
    client.on("error", end);
  }

  /** Drops kept-alive tunnels of a service whose machine is going away. */
  function drop(serviceId: string) {
    void pools.get(serviceId)?.destroy().catch(() => undefined);
    pools.delete(serviceId);
  }

  function close() {
    for (const p of pools.values()) void p.destroy().catch(() => undefined);
    pools.clear();
  }

  return { forward, upgrade, drop, close };
}

export type EdgeProxy = ReturnType<typeof createEdgeProxy>;

/** Request headers as the service receives them: no hop-by-hop headers and none of Kiln's edge credentials. */
export function forwardedHeaders(headers: IncomingHttpHeaders, opts: { stripCookie: string; clientIp?: string; proto: string; keepUpgrade: boolean }): OutgoingHttpHeaders {
  const out: OutgoingHttpHeaders = {};
  const connectionTokens = new Set(String(headers.connection ?? "").toLowerCase().split(",").map((t) => t.trim()));
  for (const [name, value] of Object.entries(headers)) {
    if (value === undefined) continue;
    if (HOP_BY_HOP.has(name) && !(opts.keepUpgrade && (name === "upgrade" || name === "connection"))) continue;
    if (name === "expect") continue; // the 100-continue handshake was already answered on the client's hop
    if (connectionTokens.has(name) && !opts.keepUpgrade) continue;
    out[name] = value;
  }
  if (typeof headers.cookie === "string") {
    const kept = headers.cookie
      .split(";")
      .map((c) => c.trim())
      .filter((c) => c && !c.startsWith(`${opts.stripCookie}=`));
    if (kept.length) out.cookie = kept.join("; ");
    else delete out.cookie;
  }
  if (opts.clientIp) out["x-forwarded-for"] = headers["x-forwarded-for"] ? `${headers["x-forwarded-for"]}, ${opts.clientIp}` : opts.clientIp;
  out["x-forwarded-proto"] = opts.proto;
  if (headers.host) out["x-forwarded-host"] = headers.host;
  return out;
}

/** Response headers as the client receives them (hop-by-hop ones dropped; Node frames the body itself). */
export function returnedHeaders(headers: IncomingHttpHeaders): OutgoingHttpHeaders {
  const out: OutgoingHttpHeaders = {};
  for (const [name, value] of Object.entries(headers)) if (value !== undefined && !HOP_BY_HOP.has(name)) out[name] = value;
  return out;
}
