// The data path of the edge and of the E2B port proxy: HTTP requests and upgrades forwarded to a port inside a machine
// through the guest agent's port tunnel. Bodies stream both ways (nothing is buffered whole); tunnels are kept alive
// per upstream and reused. Every wait has a bound and each upstream a bounded share, so a service that never answers
// stalls neither itself forever nor any other; a connection becomes a pipe only when the service switched protocols.
// Long on purpose: the bounds (per-upstream shares, waits, kept-alive tunnels) only read right beside the data path.

import { Pool } from "undici";
import type { Dispatcher } from "undici";
import { request as httpRequest } from "node:http";
import type { IncomingHttpHeaders, IncomingMessage, OutgoingHttpHeaders, ServerResponse } from "node:http";
import type { Duplex } from "node:stream";
import type { Socket } from "node:net";
import { KilnError } from "../errors.ts";
import { DEFAULT_PROXY_LIMITS } from "./proxy-limits.ts";
import type { ProxyLimits } from "./proxy-limits.ts";

export { DEFAULT_PROXY_LIMITS };
export type { ProxyLimits };

/** Headers that belong to one hop and never cross the proxy. */
const HOP_BY_HOP = new Set(["connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"]);


export interface ForwardRequest {
  method: string;
  /** Path and query as the service should see them (the /edge/<id> prefix and the token removed). */
  path: string;
  headers: OutgoingHttpHeaders;
  body: IncomingMessage | undefined;
}

export interface UpgradeRequest {
  method: string;
  path: string;
  headers: OutgoingHttpHeaders;
}

export interface UpgradeOptions {
  /** Whether the service's 101 may stand: `offered` are the client's Upgrade tokens, `answered` the service's. */
  accept(offered: string[], answered: string[]): boolean;
  /** When the pipe must close (the credential that opened it expires), epoch ms. */
  until?: number;
}

/** One upstream (a service, a sandbox's port): its tunnels, its share of requests and its open pipes. */
interface Upstream {
  pool: Pool;
  active: number;
  waiting: { admit: () => void; fail: (err: Error) => void }[];
  pipes: Set<Duplex>;
  lastUsed: number;
}

/** An Upgrade header's protocol tokens, lower-cased (`websocket`, `h2c`); empty when there is none. */
export function upgradeTokens(value: string | string[] | number | undefined): string[] {
  if (value === undefined) return [];
  return String(Array.isArray(value) ? value.join(",") : value)
    .split(",")
    .map((t) => t.trim().split("/")[0].toLowerCase())
    .filter(Boolean);
}

/** The only upgrade Kiln's own routes and the edge honour: a WebSocket handshake (RFC 6455). */
export function isWebSocketUpgrade(req: IncomingMessage): boolean {
  return upgradeTokens(req.headers.upgrade).includes("websocket") && String(req.headers.connection ?? "").toLowerCase().includes("upgrade");
}

/** The only 101 Kiln splices: to a WebSocket handshake, switching to WebSocket and nothing else. */
export function acceptWebSocket(offered: string[], answered: string[]): boolean {
  return offered.includes("websocket") && answered.length === 1 && answered[0] === "websocket";
}

/** A tunnel to an upstream: `http` for the kept-alive connections of the pool, `pipe` for an upgraded connection. */
export type OpenTunnel = (key: string, use: "http" | "pipe") => Promise<Socket>;

export function createUpstreamProxy(open: OpenTunnel, limits: ProxyLimits = DEFAULT_PROXY_LIMITS) {
  const upstreams = new Map<string, Upstream>();
  // A coarse clock the watchdog advances each tick, for when an upstream was last used (the sweep counts minutes).
  let clock = Date.now();
  // Pools of upstreams nobody used for a while go (a sandbox's port the client is done with, a stopped service).
  const sweeper = setInterval(() => {
    const now = Date.now();
    for (const [key, u] of upstreams) if (u.active === 0 && u.waiting.length === 0 && u.pipes.size === 0 && now - u.lastUsed > 60_000) drop(key);
  }, 30_000);
  sweeper.unref();

  /** A tunnel, or a clear failure within the connect bound (a tunnel that comes later is closed). */
  function openTunnel(key: string, use: "http" | "pipe"): Promise<Socket> {
    return new Promise((resolve, reject) => {
      let late = false;
      const timer = setTimeout(() => {
        late = true;
        reject(new KilnError("unavailable", `The service did not accept a connection within ${limits.connectTimeoutMs / 1000} s`, { detail: { retryable: true } }));
      }, limits.connectTimeoutMs);
      open(key, use).then(
        (socket) => {
          clearTimeout(timer);
          if (late) socket.destroy();
          else resolve(socket);
        },
        (err: unknown) => {
          clearTimeout(timer);
          if (!late) reject(err);
        },
      );
    });
  }

  function upstreamFor(key: string): Upstream {
    let u = upstreams.get(key);
    if (!u) {
      u = {
        pool: new Pool("http://service", {
          connections: limits.connections,
          pipelining: 1,
          keepAliveTimeout: 30_000,
          // The proxy's own timers bound each request (see forward): undici's would not see a live upload.
          headersTimeout: 0,
          bodyTimeout: 0,
          connect: (_opts, callback) => {
            openTunnel(key, "http").then(
              (socket) => callback(null, socket),
              (err: Error) => callback(err, null),
            );
          },
        }),
        active: 0,
        waiting: [],
        pipes: new Set(),
        lastUsed: Date.now(),
      };
      upstreams.set(key, u);
    }
    u.lastUsed = clock;
    return u;
  }

  /** A place among the upstream's busy connections: after a bounded wait in its bounded queue, or 503. */
  function waitForPlace(u: Upstream, res: ServerResponse): Promise<void> {
    if (u.waiting.length >= limits.queue) {
      return Promise.reject(new KilnError("unavailable", `The service has ${limits.connections} requests in flight and ${limits.queue} waiting: try again shortly`, { detail: { retryable: true } }));
    }
    return new Promise((resolve, reject) => {
      const entry = {
        admit: () => {
          clearTimeout(timer);
          res.off("close", gone);
          u.active++;
          resolve();
        },
        fail: (err: Error) => {
          clearTimeout(timer);
          res.off("close", gone);
          const i = u.waiting.indexOf(entry);
          if (i >= 0) u.waiting.splice(i, 1);
          reject(err);
        },
      };
      const timer = setTimeout(
        () => entry.fail(new KilnError("unavailable", `The service stayed busy for ${limits.headersTimeoutMs / 1000} s: try again shortly`, { detail: { retryable: true } })),
        limits.headersTimeoutMs,
      );
      const gone = () => entry.fail(new Error("the client went away"));
      res.once("close", gone);
      u.waiting.push(entry);
    });
  }

  function release(u: Upstream): void {
    u.active--;
    u.lastUsed = clock;
    const next = u.waiting.shift();
    if (next) next.admit();
  }

  /**
   * Sends the request and writes the service's answer to `res` as it arrives, pausing the service whenever the
   * client is slower. Rejects before any byte is written when the service cannot be reached (503), is busy (503) or
   * sends no head in time (504); `headOf` may change the service's head (`out`) and adds headers (the edge cookie).
   */
  function forward(key: string, req: ForwardRequest, res: ServerResponse, headOf: (status: number, out: OutgoingHttpHeaders) => Record<string, string[]>): Promise<number> {
    const u = upstreamFor(key);
    const go = () => dispatch(u, req, res, headOf).finally(() => release(u));
    // The common case takes a place at once, without a promise of its own.
    if (u.active < limits.connections) {
      u.active++;
      return go();
    }
    return waitForPlace(u, res).then(go);
  }

  /**
   * One watchdog for every request in flight (a timer per request would cost more than the proxying): each tick,
   * a request that made no progress for longer than its phase allows is aborted.
   */
  interface Watch {
    progress(): number;
    seen: number;
    quietSince: number;
    phase: "head" | "body";
    controller: Dispatcher.DispatchController | undefined;
    /** When the request was sent on, and whether the client's body is still arriving (a drip is progress, not an end). */
    startedAt: number;
    uploading(): boolean;
  }
  const watched = new Set<Watch>();
  const tick = Math.max(20, Math.min(1000, Math.floor(Math.min(limits.headersTimeoutMs, limits.idleTimeoutMs, limits.requestTimeoutMs) / 4)));
  const watchdog = setInterval(() => {
    const now = (clock = Date.now());
    for (const w of watched) {
      if (w.controller && now - w.startedAt > limits.requestTimeoutMs && w.uploading()) {
        watched.delete(w);
        w.controller.abort(new KilnError("timeout", `The request body was not received within ${limits.requestTimeoutMs / 1000} s`));
        continue;
      }
      const p = w.progress();
      if (p !== w.seen) {
        w.seen = p;
        w.quietSince = now;
        continue;
      }
      const bound = w.phase === "head" ? limits.headersTimeoutMs : limits.idleTimeoutMs;
      if (now - w.quietSince < bound || !w.controller) continue; // no controller yet: the tunnel is still opening (bounded)
      watched.delete(w);
      w.controller.abort(
        w.phase === "head"
          ? new KilnError("timeout", `The service sent no answer within ${bound / 1000} s`, { detail: { retryable: true } })
          : new Error(`the body was idle for ${bound / 1000} s`),
      );
    }
  }, tick);
  watchdog.unref();

  function dispatch(u: Upstream, req: ForwardRequest, res: ServerResponse, headOf: (status: number, out: OutgoingHttpHeaders) => Record<string, string[]>): Promise<number> {
    return new Promise((resolve, reject) => {
      let status = 0;
      // Progress is anything moving: the client's upload (bytes read off its socket), the answer's bytes, a drain.
      let moved = 0;
      const socket = res.socket;
      const body = req.body;
      const w: Watch = { progress: () => (socket?.bytesRead ?? 0) + moved, seen: 0, quietSince: Date.now(), phase: "head", controller: undefined, startedAt: Date.now(), uploading: () => !!body && !body.complete && !body.destroyed };
      w.seen = w.progress();
      watched.add(w);
      const finish = () => watched.delete(w);
      const handler: Dispatcher.DispatchHandler = {
        onRequestStart(c) {
          w.controller = c;
          res.once("close", () => {
            if (!res.writableFinished) c.abort(new Error("the client went away"));
          });
        },
        onResponseStart(c, statusCode, headers) {
          status = statusCode;
          if (statusCode < 200) return; // 1xx informational answers are not relayed
          w.phase = "body";
          w.quietSince = Date.now();
          const out = returnedHeaders(headers as IncomingHttpHeaders);
          for (const [k, v] of Object.entries(headOf(statusCode, out))) {
            const prev = out[k];
            out[k] = prev === undefined ? v : [...(Array.isArray(prev) ? prev : [String(prev)]), ...v];
          }
          res.writeHead(statusCode, out);
          res.on("drain", () => {
            moved++;
            c.resume();
          });
        },
        onResponseData(c, chunk) {
          moved += chunk.length;
          if (!res.write(chunk)) c.pause();
        },
        onResponseEnd() {
          finish();
          res.end();
          resolve(status);
        },
        onResponseError(_c, err) {
          finish();
          if (res.headersSent) {
            res.destroy(err);
            resolve(status);
          } else reject(err);
        },
      };
      u.pool.dispatch(
        { method: req.method as Dispatcher.HttpMethod, path: req.path, headers: req.headers as Record<string, string | string[]>, body: req.body ?? null },
        handler,
      );
    });
  }

  /**
   * Replays an upgrade request on a fresh tunnel. A 101 the options accept splices the two sockets (until `until`);
   * any other answer is relayed as an ordinary response and the connection closed, so it never becomes a pipe the
   * service did not agree to. Resolves with the status relayed; rejects (nothing written) when there was none.
   */
  async function upgrade(key: string, req: UpgradeRequest, client: Duplex, head: Buffer, opts: UpgradeOptions): Promise<number> {
    const u = upstreamFor(key);
    if (u.pipes.size >= limits.upgrades) throw new KilnError("unavailable", `The service has ${limits.upgrades} upgraded connections open: try again shortly`, { detail: { retryable: true } });
    const tunnel = await openTunnel(key, "pipe");
    return new Promise((resolve, reject) => {
      let settled = false;
      const settle = (fn: () => void) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        client.off("close", clientGone);
        fn();
      };
      const up = httpRequest({ method: req.method, path: req.path, headers: req.headers, createConnection: () => tunnel });
      const timer = setTimeout(() => {
        up.destroy();
        settle(() => reject(new KilnError("timeout", `The service sent no answer to the upgrade within ${limits.headersTimeoutMs / 1000} s`, { detail: { retryable: true } })));
      }, limits.headersTimeoutMs);
      const clientGone = () => {
        up.destroy();
        settle(() => reject(new Error("the client went away")));
      };
      client.once("close", clientGone);
      up.on("error", (err) => settle(() => reject(err)));
      up.on("upgrade", (res, socket, upHead) => {
        if (res.statusCode !== 101 || !opts.accept(upgradeTokens(req.headers.upgrade), upgradeTokens(res.headers.upgrade))) {
          socket.destroy();
          return settle(() => reject(new KilnError("unavailable", "The service switched to a protocol the request did not ask for", { detail: { retryable: false } })));
        }
        settle(() => {
          client.write(responseHead(res, []));
          if (upHead.length) client.write(upHead);
          if (head.length) socket.write(head);
          splice(u, client, socket, opts.until);
          resolve(101);
        });
      });
      up.on("response", (res) => {
        settle(() => {
          // Not a switch: an ordinary answer, then the connection ends (its later bytes must never reach the service).
          client.write(responseHead(res, ["connection: close"]));
          let idle = setTimeout(() => client.destroy(), limits.idleTimeoutMs);
          res.on("data", (chunk: Buffer) => {
            idle.refresh();
            if (!client.write(chunk)) {
              res.pause();
              client.once("drain", () => res.resume());
            }
          });
          res.on("end", () => {
            clearTimeout(idle);
            client.end();
            tunnel.destroy();
          });
          res.on("error", () => client.destroy());
          client.once("close", () => {
            clearTimeout(idle);
            idle = undefined as never;
            tunnel.destroy();
          });
          resolve(res.statusCode ?? 502);
        });
      });
      up.end();
    });
  }

  /** Joins the client and the service byte for byte until either side ends, the upstream is dropped, or `until`. */
  function splice(u: Upstream, client: Duplex, service: Duplex, until: number | undefined): void {
    u.pipes.add(client);
    let expiry: NodeJS.Timeout | undefined;
    const end = () => {
      if (expiry) clearTimeout(expiry);
      u.pipes.delete(client);
      u.lastUsed = Date.now();
      service.destroy();
      client.destroy();
    };
    if (until !== undefined) {
      // setTimeout holds at most 2^31-1 ms: a far expiry is reached in steps.
      const arm = () => {
        const left = until - Date.now();
        if (left <= 0) return end();
        expiry = setTimeout(arm, Math.min(left, 0x7fffffff));
      };
      arm();
    }
    service.pipe(client);
    client.pipe(service);
    service.once("close", end);
    client.once("close", end);
    service.on("error", end);
    client.on("error", end);
  }

  /** Drops the kept-alive tunnels and open pipes of an upstream that is going away. */
  function drop(key: string) {
    const u = upstreams.get(key);
    if (!u) return;
    upstreams.delete(key);
    void u.pool.destroy().catch(() => undefined);
    for (const pipe of u.pipes) pipe.destroy();
    for (const w of [...u.waiting]) w.fail(new KilnError("unavailable", "The service is going away", { detail: { retryable: true } }));
  }

  function close() {
    clearInterval(sweeper);
    clearInterval(watchdog);
    for (const key of [...upstreams.keys()]) drop(key);
  }

  /** What the proxy holds for one upstream (tests and diagnostics). */
  function stats(key: string) {
    const u = upstreams.get(key);
    return { active: u?.active ?? 0, waiting: u?.waiting.length ?? 0, pipes: u?.pipes.size ?? 0 };
  }

  return { forward, upgrade, drop, close, stats };
}

export type UpstreamProxy = ReturnType<typeof createUpstreamProxy>;

/** The status line and headers of an upstream answer as the client receives them, plus `extra` lines. */
function responseHead(res: IncomingMessage, extra: string[]): string {
  const lines = [`HTTP/1.1 ${res.statusCode} ${res.statusMessage ?? ""}`.trimEnd()];
  const switching = res.statusCode === 101;
  for (let i = 0; i < res.rawHeaders.length; i += 2) {
    const name = res.rawHeaders[i].toLowerCase();
    // A 101 keeps its Connection/Upgrade (they are the switch); other answers lose every hop-by-hop header.
    if (!switching && (HOP_BY_HOP.has(name) || name === "content-length")) continue;
    lines.push(`${res.rawHeaders[i]}: ${res.rawHeaders[i + 1]}`);
  }
  return [...lines, ...extra, "", ""].join("\r\n");
}

/** Request headers as the service receives them: no hop-by-hop headers and none of Kiln's edge credentials. */
export function forwardedHeaders(headers: IncomingHttpHeaders, opts: { stripCookie?: string; clientIp?: string; proto: string; keepUpgrade: boolean }): OutgoingHttpHeaders {
  const out: OutgoingHttpHeaders = {};
  const connectionTokens = new Set(String(headers.connection ?? "").toLowerCase().split(",").map((t) => t.trim()));
  for (const [name, value] of Object.entries(headers)) {
    if (value === undefined) continue;
    if (HOP_BY_HOP.has(name) && !(opts.keepUpgrade && (name === "upgrade" || name === "connection"))) continue;
    if (name === "expect") continue; // the 100-continue handshake was already answered on the client's hop
    if (connectionTokens.has(name) && !opts.keepUpgrade) continue;
    out[name] = value;
  }
  if (opts.stripCookie && typeof headers.cookie === "string") {
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
