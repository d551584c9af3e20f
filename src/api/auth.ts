// Authentication as a property of the matched route: every route declares `config.auth`, a route without it stops
// the server from starting, and one onRequest hook (after routing, for HTTP and WebSocket upgrades alike) enforces it.
// Sockets remember the API keys they carried and close within a second of a key's revocation.

import { KILN_BEARER_SUBPROTOCOL } from "../deployments/credentials.ts";
import type { IncomingMessage, ServerResponse } from "node:http";
import type { FastifyRequest, RouteOptions } from "fastify";
import type { WebSocket } from "ws";
import type { App } from "./app-type.ts";
import { KilnError } from "../errors.ts";
import type { KeyService } from "../keys/service.ts";
import { hasClusterHeaders } from "../hosts/cluster-auth.ts";
import { routeConfigOf } from "./route-config.ts";
import type { Forwarded } from "../hosts/cluster-auth.ts";

/** Checks a forwarded request's cluster signature (src/hosts/cluster-auth.ts): who sent it for which key, or throws. */
export type ClusterVerifier = (method: string, path: string, headers: FastifyRequest["headers"]) => Forwarded;

/**
 * DESIGN.md §6. `key`: an API key (Authorization: Bearer, or E2B's X-API-Key); `none`: public; `envd-token`: an E2B
 * sandbox's access token; `e2b-volume-token`: an E2B volume's token (its content API); `e2b-upload`: a signed E2B
 * template file upload link; `edge-token`: a deployment service's signed edge token; `cluster`: host-to-host calls (a
 * peer's own request, signed with the cluster secret for no key: the layer fetch; refused without a signature). A
 * request forwarded by another host of the store carries a cluster signature instead of the caller's credential: for
 * a `key`, `envd-token`, `e2b-volume-token` or `e2b-upload` route the signed key id stands for the key the first
 * server found behind the credential (the token's or upload link's key for E2B's), and that key must still be active here; an `edge-token` route checks its
 * own credential as usual. Cluster headers that do not verify
 * are refused (401), whatever the route.
 */
export const AUTH_KINDS = ["key", "none", "envd-token", "e2b-volume-token", "e2b-upload", "edge-token", "cluster"] as const;
export type AuthKind = (typeof AUTH_KINDS)[number];
/** The kinds whose credential a forwarded request carries as the signed key id (the first server checked it). */
const FORWARDED_KINDS = new Set<AuthKind>(["key", "envd-token", "e2b-volume-token", "e2b-upload"]);

/**
 * Checks a request's credential for one kind: answers the id of the API key the credential stands for (undefined
 * when it stands for none, as an edge token), or throws the refusal (a KilnError, 401 for a bad credential).
 */
export type Verifier = (req: FastifyRequest) => string | undefined | Promise<string | undefined>;

/** One registered route as the auth hook sees it; `constrained`: it matches only with its constraint (E2B's envd routes). */
export interface RouteAuth {
  method: string;
  url: string;
  auth: AuthKind;
  websocket: boolean;
  constrained: boolean;
}

/** WebSocket close code sent when the key a socket was opened with is revoked (1008: policy violation). */
export const REVOKED_CLOSE_CODE = 1008;
/** A revoked socket that does not finish its close handshake in this long is cut. */
const CLOSE_GRACE_MS = 500;

const kWebSocket = Symbol("kiln.webSocket");
type RawRequest = IncomingMessage & { [kWebSocket]?: WebSocket };

const KINDS = new Set<string>(AUTH_KINDS);

export function unauthorized(message: string): KilnError {
  return new KilnError("unauthorized", message, { detail: { code: "unauthorized", phase: "auth" } });
}

/**
 * WebSocket subprotocols a browser offers in place of the Authorization header it cannot set on an upgrade:
 * `kiln.v1` (the one the server selects) and `kiln.bearer.<base64url of the key>` (never echoed back).
 */
export const WS_PROTOCOL = "kiln.v1";
export const WS_BEARER_PREFIX = KILN_BEARER_SUBPROTOCOL;

/**
 * The API key a request presents: `Authorization: Bearer <key>`, else `X-API-Key: <key>` (the E2B SDK's header),
 * else, on a WebSocket upgrade only, a `kiln.bearer.` subprotocol (browsers, the console).
 */
export function presentedKey(req: FastifyRequest): string | undefined {
  const header = req.headers.authorization;
  if (typeof header === "string") {
    const match = /^Bearer\s+(\S+)\s*$/i.exec(header);
    return match ? match[1] : undefined;
  }
  const apiKey = req.headers["x-api-key"];
  if (typeof apiKey === "string" && apiKey) return apiKey;
  return req.headers.upgrade ? subprotocolKey(req.headers["sec-websocket-protocol"]) : undefined;
}

function subprotocolKey(header: string | undefined): string | undefined {
  if (!header || header.length > 4096) return undefined;
  const offered = header.split(",").map((p) => p.trim()).filter((p) => p.startsWith(WS_BEARER_PREFIX));
  if (offered.length !== 1) return undefined;
  const encoded = offered[0].slice(WS_BEARER_PREFIX.length);
  if (!/^[A-Za-z0-9_-]{1,1024}$/.test(encoded)) return undefined;
  const key = Buffer.from(encoded, "base64url").toString("utf8");
  return /^\S+$/.test(key) ? key : undefined;
}

export function createAuth(keys: KeyService) {
  const verifiers = new Map<AuthKind, Verifier>();
  /** Requests in flight (a WebSocket for as long as it is open, an SSE stream until it ends) by the key they carry. */
  const live = new Map<string, Map<RawRequest, ServerResponse>>();

  const keyVerifier: Verifier = (req) => {
    const key = presentedKey(req);
    if (!key) throw unauthorized("Missing API key: send Authorization: Bearer <key>");
    const checked = keys.verify(key);
    const answer = (keyId: string | null) => {
      if (!keyId) throw unauthorized("Invalid or revoked API key");
      return keyId;
    };
    return typeof checked === "string" || checked === null ? answer(checked) : checked.then(answer);
  };
  verifiers.set("key", keyVerifier);
  verifiers.set("none", () => undefined);

  /** Lets the part of the server that owns a credential (the edge, the E2B layer) check it for its kind. */
  function provide(kind: Exclude<AuthKind, "key" | "none">, verifier: Verifier) {
    verifiers.set(kind, verifier);
  }

  /**
   * Remembers a request of key `keyId` until its response closes (for an upgrade: until the socket does). Only the
   * request is tracked, not its keep-alive connection: the next request on it is authenticated again.
   */
  function track(req: RawRequest, res: ServerResponse, keyId: string) {
    let requests = live.get(keyId);
    if (!requests) live.set(keyId, (requests = new Map()));
    requests.set(req, res);
    res.once("close", () => {
      requests.delete(req);
      if (requests.size === 0 && live.get(keyId) === requests) live.delete(keyId);
    });
  }

  /**
   * A revoked key's requests in flight: a WebSocket gets a close frame (and is cut if it does not close), anything
   * else still unanswered after a short grace (an SSE stream, a long exec) has its connection cut. The grace lets
   * the request that revoked its own key get its answer.
   */
  function closeRevoked(ids: string[]) {
    for (const id of ids) {
      const requests = live.get(id);
      if (!requests) continue;
      live.delete(id);
      for (const [req, res] of requests) {
        const ws = req[kWebSocket];
        if (ws && ws.readyState === ws.OPEN) ws.close(REVOKED_CLOSE_CODE, "the API key was revoked");
        const socket = req.socket;
        setTimeout(() => {
          if (ws ? ws.readyState !== ws.CLOSED : !res.writableEnded) socket?.destroy();
        }, CLOSE_GRACE_MS).unref();
      }
    }
  }
  keys.onRevoked(closeRevoked);

  let clusterVerifier: ClusterVerifier | undefined;
  /** Lets this server accept requests its peers forward (a server without a store-wide cluster accepts none). */
  function provideCluster(verifier: ClusterVerifier) {
    clusterVerifier = verifier;
  }

  /** Every route the server registered, with its declared auth: the route table the hostile-input suite walks. */
  const table: RouteAuth[] = [];

  /** The one authentication hook: the matched route's declared kind decides; an unmatched request needs a key. */
  function install(app: App) {
    // Fail closed: a route (ours or a plugin's) that does not say how it is authenticated does not register.
    app.addHook("onRoute", (route: RouteOptions) => {
      const auth = (route.config as { auth?: unknown } | undefined)?.auth;
      const methods = Array.isArray(route.method) ? route.method : [route.method];
      if (typeof auth !== "string" || !KINDS.has(auth)) {
        throw new Error(`route ${methods.join(",")} ${route.url} declares no auth (config.auth must be one of ${AUTH_KINDS.join(", ")}): refusing to start`);
      }
      const constraints = (route as { constraints?: Record<string, unknown> }).constraints ?? {};
      for (const method of methods) table.push({ method, url: route.url, auth: auth as AuthKind, websocket: Boolean((route as { websocket?: boolean }).websocket), constrained: Object.keys(constraints).length > 0 });
    });
    app.decorate("routeTable", () => table.map((r) => ({ ...r })));

    // Callback style: this runs on every request, and a promise per request is measurable at this rate.
    app.addHook("onRequest", (req, reply, done) => {
      reply.header("x-request-id", req.id);
      // An unmatched path needs a key like any API route, so route existence is not revealed to strangers.
      const route = routeConfigOf(req);
      const kind: AuthKind = route.url === undefined ? "key" : (route.auth as AuthKind);
      let forwarded: Forwarded | undefined;
      if (hasClusterHeaders(req.headers)) {
        // A forged or replayed forward never falls back to other credentials.
        if (!clusterVerifier) return done(unauthorized("This server accepts no forwarded requests"));
        try {
          forwarded = clusterVerifier(req.method, req.url, req.headers);
          req.forwardedBy = forwarded.from;
        } catch (err) {
          return done(err as Error);
        }
      }
      if (kind === "none") return done();
      // What a credential opens is that caller's data: no browser or shared cache keeps it (a route that streams may
      // say `no-cache` instead). An edge service's answers are the service's to mark; a peer's calls are not a browser's.
      if (kind !== "edge-token" && kind !== "cluster") reply.header("cache-control", "no-store");
      const verifier = verifierFor(kind, forwarded);
      if (!verifier) return done(unauthorized(`This route's credential (${kind}) is not accepted by this server`));
      const accept = (keyId: string | undefined) => {
        if (keyId !== undefined) {
          // A revocation that landed while the credential was being checked wins.
          if (keys.isRevoked(keyId)) throw unauthorized("Invalid or revoked API key");
          req.apiKeyId = keyId;
          track(req.raw, reply.raw, keyId);
        }
      };
      let result: ReturnType<Verifier>;
      try {
        result = verifier(req);
        if (typeof result === "string" || result === undefined) {
          accept(result);
          return done();
        }
      } catch (err) {
        return done(err as Error);
      }
      result.then(
        (keyId) => {
          try {
            accept(keyId);
          } catch (err) {
            return done(err as Error);
          }
          done();
        },
        (err: Error) => done(err),
      );
    });
  }

  /**
   * The check for a request to a route of `kind`, or undefined when this server accepts no credential of that kind.
   * A request a peer forwarded (`forwarded`: its verified cluster signature) is checked on the signature: a `cluster`
   * route (a peer's own call, as a layer fetch) on the signature alone, for no key; a FORWARDED_KINDS route on the key
   * id it signs. Any other request, and an `edge-token` route's even when forwarded, checks its own credential.
   */
  function verifierFor(kind: AuthKind, forwarded: Forwarded | undefined): Verifier | undefined {
    if (forwarded && kind === "cluster") return () => undefined;
    if (forwarded && FORWARDED_KINDS.has(kind)) return forwardedVerifier(forwarded.keyId);
    return verifiers.get(kind);
  }

  /** A forwarded request's key: the id the first server authenticated, still active here. */
  function forwardedVerifier(keyId: string | undefined): Verifier {
    return async () => {
      if (!keyId) throw unauthorized("The forwarded request names no API key");
      if (!(await keys.isActive(keyId))) throw unauthorized("Invalid or revoked API key");
      return keyId;
    };
  }

  /** Call once @fastify/websocket is registered: a revoked key's WebSocket is then closed with a close frame. */
  function watchWebSockets(app: App) {
    const wss = (app as unknown as { websocketServer: { on(e: "connection", fn: (ws: WebSocket, req: RawRequest) => void): void } }).websocketServer;
    wss.on("connection", (ws, rawReq) => {
      rawReq[kWebSocket] = ws;
    });
  }

  return { install, provide, provideCluster, watchWebSockets };
}

export type Auth = ReturnType<typeof createAuth>;
