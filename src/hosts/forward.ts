// Any server answers for any machine: a host-bound request (a machine's REST and WebSocket, a volume's files and
// WebSocket, a build's live log and cancel, a snapshot's delete, a deployment replica's logs and restart) whose machine (volume, build, snapshot) is on
// another active host is forwarded there once this server has authenticated the caller, streaming both ways (the
// request body as it arrives, the answer as it comes; a WebSocket spliced byte for byte), signed with the cluster
// secret. Placement forwards a create the same way, to the host it chose.

import { request as httpRequest } from "node:http";
import type { IncomingMessage, OutgoingHttpHeaders } from "node:http";
import type { Duplex } from "node:stream";
import { pipeline } from "node:stream/promises";
import { Agent, request } from "undici";
import type { Dispatcher } from "undici";
import type { FastifyReply, FastifyRequest } from "fastify";
import { KilnError, toEnvelope } from "../errors.ts";
import type { Logger } from "../log.ts";
import type { Db, HostRow } from "../store/schema.ts";
import type { ClusterAuth } from "./cluster-auth.ts";
import { CLUSTER_HEADERS } from "./cluster-auth.ts";

/** Headers that belong to one hop, and the caller's credentials (the peer trusts the signed key id instead). */
const NOT_FORWARDED = new Set([
  "connection",
  "keep-alive",
  "proxy-connection",
  "proxy-authenticate",
  "proxy-authorization",
  "te",
  "trailer",
  "transfer-encoding",
  "upgrade",
  "host",
  "expect",
  ...Object.values(CLUSTER_HEADERS),
]);
const HOP_BY_HOP_ANSWER = new Set(["connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "trailer"]);
/** Machine ids → their host, remembered (a machine never moves); bounded. */
const OWNERS_MAX = 50_000;
/** How long a peer may take to accept a connection, and to answer an upgrade. */
const CONNECT_TIMEOUT_MS = 5_000;
const UPGRADE_ANSWER_MS = 30_000;

export interface ForwardTarget {
  id: string;
  url: string;
}

/**
 * What a host-bound request is bound to: a machine, a volume (its data), a build (its live log), a snapshot (its
 * files), a deployment's replica (its output and process, in its machine), or a host named outright (`hosts`: the id
 * is the host's; E2B's template uploads, src/compat/e2b/templates.ts).
 */
export type BoundKind = "machines" | "volumes" | "builds" | "snapshots" | "services" | "hosts";
export interface Bound {
  kind: BoundKind;
  id: string;
}

/**
 * The record a route is bound to (its `:id`, or `:build_id`): served on the host that holds it. A record itself is
 * any server's to read; what needs the host's processes or files is bound.
 */
export function boundTo(method: string, routeUrl: string | undefined, params: Record<string, string | undefined>): Bound | undefined {
  if (!routeUrl) return undefined;
  const bound = (kind: BoundKind, id: string | undefined) => (id ? { kind, id } : undefined);
  if (routeUrl.startsWith("/v1/machines/:id/") || (routeUrl === "/v1/machines/:id" && method === "DELETE")) return bound("machines", params.id);
  if (routeUrl.startsWith("/v1/volumes/:id/") || (routeUrl === "/v1/volumes/:id" && method === "DELETE")) return bound("volumes", params.id);
  if (routeUrl === "/v1/templates/:id/builds/:build_id/logs" || routeUrl === "/v1/templates/:id/builds/:build_id/cancel") return bound("builds", params.build_id);
  if (routeUrl === "/v1/snapshots/:id" && method === "DELETE") return bound("snapshots", params.id);
  if (routeUrl === "/v1/agent-deployments/:deployment_id/services/:service_id/logs" || routeUrl === "/v1/agent-deployments/:deployment_id/services/:service_id/restart") {
    return bound("services", params.service_id);
  }
  return undefined;
}

export function createForwarder(deps: { db: Db; hostId: string; auth: ClusterAuth; log: Logger; hosts: () => Promise<Map<string, HostRow>> }) {
  const { db, hostId, auth, log } = deps;
  const owners = new Map<string, string>();
  // Peers are trusted and bound their own requests: no header or body timeouts here (a long exec may be silent).
  const agent = new Agent({ keepAliveTimeout: 30_000, headersTimeout: 0, bodyTimeout: 0, connect: { timeout: CONNECT_TIMEOUT_MS } });

  /**
   * The host a machine (volume, build, snapshot) is on, when it is another one; undefined: serve it here (ours,
   * unknown — the route answers 404 — or recorded without a host; a named host that is unknown or lost). Machines,
   * builds and snapshots never move, so their host is remembered.
   */
  async function ownerOf(target: Bound | string): Promise<HostRow | undefined> {
    const { kind, id } = typeof target === "string" ? { kind: "machines" as const, id: target } : target;
    const cacheKey = `${kind}:${id}`;
    let owner = kind === "hosts" ? id : owners.get(cacheKey);
    if (owner === undefined && kind !== "hosts") {
      // A replica is on its machine's host.
      const row =
        kind === "services"
          ? await db.selectFrom("services").innerJoin("machines", "machines.id", "services.machine_id").select("machines.host_id as host_id").where("services.id", "=", id).executeTakeFirst()
          : await db.selectFrom(kind).select("host_id").where("id", "=", id).executeTakeFirst();
      if (!row?.host_id) return undefined;
      owner = row.host_id;
      if (kind !== "volumes") {
        if (owners.size >= OWNERS_MAX) owners.delete(owners.keys().next().value!);
        owners.set(cacheKey, owner);
      }
    }
    if (owner === undefined || owner === hostId) return undefined;
    const host = (await deps.hosts()).get(owner);
    // A lost host's machines are failed: this server answers for their records.
    return host && host.status !== "lost" ? host : undefined;
  }

  function outgoingHeaders(req: FastifyRequest, to: string, body: boolean): OutgoingHttpHeaders {
    const out: OutgoingHttpHeaders = {};
    const keyed = req.apiKeyId !== undefined;
    for (const [name, value] of Object.entries(req.headers)) {
      if (value === undefined || NOT_FORWARDED.has(name)) continue;
      if (keyed && (name === "authorization" || name === "x-api-key")) continue;
      out[name] = value;
    }
    if (!body) delete out["content-length"];
    out["x-forwarded-for"] = req.headers["x-forwarded-for"] ? `${req.headers["x-forwarded-for"]}, ${req.ip}` : req.ip;
    // The Host the caller used (the peer's own is its address): E2B names a sandbox and its port in it.
    if (req.headers.host !== undefined) out["x-forwarded-host"] = req.headers.host;
    else delete out["x-forwarded-host"];
    return { ...out, ...auth.sign(req.method, req.url, to, req.apiKeyId) };
  }

  /**
   * Streams the request to the peer and its answer back. `body`: a buffered body to send instead of the request's
   * own stream (placement, which may try several hosts); `accept`: whether to relay this status (false: the caller
   * tries another host, nothing was written).
   */
  async function forwardHttp(req: FastifyRequest, reply: FastifyReply, target: ForwardTarget, opts: { body?: Buffer; accept?: (status: number) => boolean } = {}): Promise<boolean> {
    const streamed = opts.body === undefined && (req.headers["content-length"] !== undefined || req.headers["transfer-encoding"] !== undefined);
    const headers = outgoingHeaders(req, target.id, streamed || opts.body !== undefined);
    if (opts.body !== undefined) headers["content-length"] = String(opts.body.length);
    const abort = new AbortController();
    const gone = () => abort.abort();
    reply.raw.once("close", gone);
    let res: Dispatcher.ResponseData;
    try {
      res = await request(target.url + req.url, {
        method: req.method as Dispatcher.HttpMethod,
        headers: headers as Record<string, string>,
        body: opts.body ?? (streamed ? req.raw : undefined),
        dispatcher: agent,
        signal: abort.signal,
      });
    } catch (err) {
      reply.raw.off("close", gone);
      if (opts.accept) return false;
      throw unreachable(target, err);
    }
    if (opts.accept && !opts.accept(res.statusCode)) {
      reply.raw.off("close", gone);
      await res.body.dump().catch(() => undefined);
      return false;
    }
    reply.hijack();
    const raw = reply.raw;
    const answer: OutgoingHttpHeaders = {};
    for (const [name, value] of Object.entries(res.headers)) if (value !== undefined && !HOP_BY_HOP_ANSWER.has(name)) answer[name] = value;
    raw.writeHead(res.statusCode, answer);
    raw.flushHeaders();
    try {
      await pipeline(res.body, raw);
    } catch (err) {
      if (!abort.signal.aborted) log.info({ err, host_id: target.id }, "a forwarded answer was cut");
      raw.destroy();
    } finally {
      raw.off("close", gone);
    }
    req.log.info({ method: req.method, status: res.statusCode, host_id: target.id, ms: Math.round(reply.elapsedTime * 100) / 100 }, "request forwarded");
    return true;
  }

  /** A WebSocket upgrade replayed on the peer; its 101 splices the two connections, any other answer is relayed. */
  function forwardUpgrade(req: FastifyRequest, reply: FastifyReply, target: ForwardTarget): void {
    reply.hijack();
    const client = req.raw.socket as Duplex;
    const head = upgradeHead(req);
    const headers = outgoingHeaders(req, target.id, false);
    headers.connection = "Upgrade";
    headers.upgrade = req.headers.upgrade;
    const url = new URL(target.url);
    const up = httpRequest({ host: url.hostname, port: url.port || 80, method: req.method, path: req.url, headers, timeout: UPGRADE_ANSWER_MS });
    let settled = false;
    const fail = (status: number, err?: unknown) => {
      if (settled) return;
      settled = true;
      if (err) log.info({ err, host_id: target.id }, "forwarding an upgrade failed");
      const { body } = toEnvelope(unreachable(target, err), req.id);
      const text = JSON.stringify(body);
      client.end(`HTTP/1.1 ${status} Service Unavailable\r\ncontent-type: application/json; charset=utf-8\r\ncontent-length: ${Buffer.byteLength(text)}\r\nconnection: close\r\n\r\n${text}`);
    };
    client.once("close", () => up.destroy());
    up.on("timeout", () => {
      up.destroy();
      fail(503, new Error("no answer to the upgrade"));
    });
    up.on("error", (err) => fail(503, err));
    up.on("upgrade", (res, socket, upHead) => {
      settled = true;
      up.setTimeout(0);
      client.write(responseHead(res));
      if (upHead.length) client.write(upHead);
      if (head.length) socket.write(head);
      socket.setNoDelay(true);
      const end = () => {
        socket.destroy();
        client.destroy();
      };
      socket.on("error", end).on("close", end);
      client.on("error", end).on("close", end);
      socket.pipe(client);
      client.pipe(socket);
      req.log.info({ method: req.method, status: 101, host_id: target.id }, "upgrade forwarded");
    });
    up.on("response", (res) => {
      settled = true;
      client.write(responseHead(res, ["connection: close"]));
      res.pipe(client);
    });
    up.end();
  }

  return {
    ownerOf,
    forwardHttp,
    forwardUpgrade,
    close: () => agent.close(),
  };
}

export type Forwarder = ReturnType<typeof createForwarder>;

function unreachable(target: ForwardTarget, err: unknown): KilnError {
  const why = err instanceof Error ? err.message.slice(0, 200) : "no answer";
  return new KilnError("unavailable", `The host running this machine (${target.id}) could not be reached: ${why}`, { detail: { retryable: true } });
}

function responseHead(res: IncomingMessage, extra: string[] = []): string {
  const lines = [`HTTP/1.1 ${res.statusCode} ${res.statusMessage ?? ""}`];
  const raw = res.rawHeaders;
  const skip = new Set(extra.length ? ["connection", "keep-alive", "transfer-encoding"] : []);
  for (let i = 0; i < raw.length; i += 2) if (!skip.has(raw[i].toLowerCase())) lines.push(`${raw[i]}: ${raw[i + 1]}`);
  return [...lines, ...extra, "", ""].join("\r\n");
}

/** The head buffer @fastify/websocket kept for an upgrade request (empty for every normal client). */
function upgradeHead(req: FastifyRequest): Buffer {
  const raw = req.raw as unknown as Record<symbol, unknown>;
  const sym = Object.getOwnPropertySymbols(raw).find((s) => s.description === "ws-head");
  const head = sym ? raw[sym] : undefined;
  return Buffer.isBuffer(head) ? head : Buffer.alloc(0);
}
