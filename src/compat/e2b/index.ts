// Drop-in E2B compatibility at the root of Kiln's address: E2B's control plane (/sandboxes, /v2/sandboxes …)
// and, for requests naming a sandbox (E2b-Sandbox-Id, or a `49983-<id>.` Host), that sandbox's envd.
// Its routes declare their auth like Kiln's own (auth.ts): `key` (X-API-Key) for the control plane, `envd-token` (the
// sandbox's X-Access-Token, checked here and enforced by the server's one auth hook) for envd.

import type { FastifyInstance, FastifyRequest } from "fastify";
import type { Services } from "../../services/index.ts";
import { KilnError } from "../../errors.ts";
import { controlRoutes } from "./control.ts";
import { basicUserOf, envdRoutes } from "./envd.ts";
import { e2bError } from "./errors.ts";
import { sendUnaryError } from "./connect.ts";
import { createProcessRegistry } from "./processes.ts";
import { createTokens, fileUrlSignature, loadTokenSecret, sameText } from "./token.ts";
import type { RemotePort } from "../../hosts/tunnel.ts";
import { installPortProxy, requestHost, SANDBOX_HOST_RE } from "./ports.ts";
import { machineIdOf } from "./ids.ts";
import { codeInterpreterRoutes, JUPYTER_PORT } from "./code-interpreter.ts";
import { templateBuilderRoutes } from "./templates.ts";
import type { ProxyLimits } from "../../deployments/proxy.ts";
import type { Auth } from "../../api/auth.ts";
import { presentedKey, unauthorized } from "../../api/auth.ts";
import { routeConfigOf } from "../../api/route-config.ts";
import type { Bound } from "../../hosts/forward.ts";

export const ENVD_PORT = 49983;
/** Active keys whose tokens a signed /files URL is checked against (the signature does not say which). */
const MAX_SIGNING_KEYS = 1000;

export interface E2bOptions {
  services: Services;
  /** The server's auth: this layer provides the `envd-token` check. */
  auth: Auth;
  dataDir: string;
  /** KILN_PUBLIC_URL: its host is the `domain` sandboxes report. */
  publicUrl: string;
  /** The port proxy's shares and waits (the edge's, KILN_EDGE_*). */
  limits?: ProxyLimits;
  /** KILN_BUILD_RETENTION_S: uploaded template files unused this long are removed. */
  buildRetentionS?: number;
  /** A sandbox port on another host, through the cluster tunnel (undefined: not a cluster, or the sandbox is here). */
  remotePort?: RemotePort;
}

/** The sandbox port a request names: `E2b-Sandbox-Port`, else the port of a `<port>-<id>.` Host. */
function sandboxPortOf(req: { headers: Record<string, string | string[] | undefined> }): number | undefined {
  const header = req.headers["e2b-sandbox-port"];
  if (typeof header === "string" && /^\d{1,5}$/.test(header)) return Number(header);
  const host = requestHost(req);
  const m = host ? SANDBOX_HOST_RE.exec(host) : null;
  return m ? Number(m[1]) : undefined;
}

/**
 * The machine an envd or code-interpreter request is for, or undefined when the request is neither. A header naming
 * no sandbox id is kept as it is: the request is still envd's, and its machine is not found.
 */
export function sandboxIdOf(req: { headers: Record<string, string | string[] | undefined> }): string | undefined {
  const header = req.headers["e2b-sandbox-id"];
  if (typeof header === "string" && header) return machineIdOf(header) ?? header;
  const host = requestHost(req);
  const m = host ? SANDBOX_HOST_RE.exec(host) : null;
  return m && (Number(m[1]) === ENVD_PORT || Number(m[1]) === JUPYTER_PORT) ? machineIdOf(m[2]) : undefined;
}

/** The E2B control routes that need the sandbox's own host (its processes, files or runtime), by their :id. */
const HOST_BOUND_CONTROL = /^\/(v2\/)?sandboxes\/:id(\/|$)/;

/**
 * What an E2B request is bound to in a cluster (src/hosts/routing.ts): envd and the code interpreter are served by
 * the sandbox's host, as are the control routes on one sandbox and the volume content API, and a requested template
 * build's upload link, upload, start and status by the host that builds it; the rest (create, lists, templates,
 * volumes' records) any server answers from the store.
 */
export function e2bBoundOf(req: FastifyRequest): Bound | undefined | Promise<Bound | undefined> {
  const config = routeConfigOf(req) as { e2b?: string; hostBound?: (req: FastifyRequest) => Promise<Bound | undefined>; url?: string };
  // A route that finds its host in the store says so itself (the template builder's: templates.ts).
  if (config?.hostBound) return config.hostBound(req);
  if (config?.e2b === "envd" || config?.e2b === "jupyter") {
    const id = sandboxIdOf(req);
    return id ? { kind: "machines", id } : undefined;
  }
  const url = config.url ?? "";
  const param = (req.params as { id?: unknown } | undefined)?.id;
  if (typeof param !== "string") return undefined;
  if (HOST_BOUND_CONTROL.test(url)) {
    const id = machineIdOf(param);
    return id ? { kind: "machines", id } : undefined;
  }
  if (url.startsWith("/volumecontent/:id/") || (url === "/volumes/:id" && req.method === "DELETE")) return { kind: "volumes", id: param };
  return undefined;
}

/** Which in-sandbox server a request is for: the code interpreter (port 49999) or envd (any other). */
function sandboxServerOf(req: { headers: Record<string, string | string[] | undefined> }): "envd" | "jupyter" | undefined {
  if (!sandboxIdOf(req)) return undefined;
  return sandboxPortOf(req) === JUPYTER_PORT ? "jupyter" : "envd";
}

/** KILN_PUBLIC_URL's host; none when it names port 0 (a server on an ephemeral port: the Host used is right). */
function publicDomain(publicUrl: string): string | undefined {
  const url = new URL(publicUrl);
  return url.port === "0" ? undefined : url.host;
}

export async function e2bCompat(app: FastifyInstance, opts: E2bOptions) {
  const { services } = opts;
  const secret = await loadTokenSecret(services.store.db, opts.dataDir);
  const tokens = createTokens(secret);
  const processes = createProcessRegistry(services.machines);
  app.addHook("onClose", (_app, done) => {
    processes.close();
    done();
  });

  // envd's routes answer only requests that name a sandbox, so envd's /health never shadows Kiln's /health.
  app.addConstraintStrategy({
    name: "e2bEnvd",
    storage() {
      const handlers = new Map<string, unknown>();
      return { get: (k: string) => (handlers.get(k) ?? null) as never, set: (k: string, v: unknown) => void handlers.set(k, v) };
    },
    deriveConstraint: (req: FastifyRequest["raw"]) => sandboxServerOf(req as never) as never,
    mustMatchWhenDerived: false,
  });

  app.addContentTypeParser("application/connect+json", { parseAs: "buffer" }, (_req, body, done) => done(null, body));
  app.addContentTypeParser("multipart/form-data", { parseAs: "buffer" }, (_req, body, done) => done(null, body));

  // An envd token names the key it was issued to: it works while that key is active, and its sockets are that key's.
  const envdKeyOf = async (sandboxId: string | undefined, presented: unknown): Promise<string | undefined> => {
    const keyId = sandboxId ? tokens.verify(sandboxId, presented) : undefined;
    return keyId !== undefined && (await services.keys.isActive(keyId)) ? keyId : undefined;
  };
  // The code interpreter's calls carry the sandbox's traffic token (Kiln's is the envd token), some only that one.
  // envd's /files also takes a signed URL instead of the token (`secure: true` downloadUrl/uploadUrl), as envd does.
  opts.auth.provide("envd-token", async (req) => {
    const presented = req.headers["x-access-token"] ?? req.headers["e2b-traffic-access-token"];
    if (presented === undefined && routeConfigOf(req).url === "/files") return signedKeyOf(req);
    const keyId = await envdKeyOf(sandboxIdOf(req), presented);
    if (keyId === undefined) throw unauthorized("invalid or missing X-Access-Token for this sandbox");
    return keyId;
  });

  // The volume content API takes the volume's token (`Authorization: Bearer`, as the SDK sends it): good for the
  // volume its path names while the key it was issued to is active.
  opts.auth.provide("e2b-volume-token", async (req) => {
    const volumeId = (req.params as { id?: unknown } | undefined)?.id;
    const keyId = typeof volumeId === "string" ? tokens.verifyVolume(volumeId, presentedKey(req)) : undefined;
    if (keyId === undefined || !(await services.keys.isActive(keyId))) throw unauthorized("invalid or missing volume token (Authorization: Bearer <the volume's token>) for this volume");
    return keyId;
  });

  // The active keys' ids, read from the store at most once a second: signed requests come from anyone holding a URL
  // (or guessing), so each must not cost a store query. A key revoked meanwhile is refused by isActive below.
  // A miss reads them again if the list is older than a quarter second (a key made just now on another server), so bad
  // signatures cost at most four store queries a second; a key this server made since the last read is read at once.
  let activeKeys: { at: number; generation: number; ids: Promise<string[]> } | undefined;
  function activeKeyIds(maxAgeMs = 1000): Promise<string[]> {
    const generation = services.keys.createdGeneration();
    if (!activeKeys || Date.now() - activeKeys.at > maxAgeMs || activeKeys.generation !== generation) {
      const ids = services.keys.list().then((all) => all.filter((k) => k.revoked_at === null).slice(0, MAX_SIGNING_KEYS).map((k) => k.id));
      ids.catch(() => (activeKeys = undefined));
      activeKeys = { at: Date.now(), generation, ids };
    }
    return activeKeys.ids;
  }

  /**
   * The key whose sandbox token signed this /files URL. The signature hides which key's token it used, so each
   * active key's token for the sandbox is tried (at most MAX_SIGNING_KEYS, in id order; a hash and an HMAC each).
   */
  async function signedKeyOf(req: FastifyRequest): Promise<string> {
    const q = req.query as Record<string, unknown>;
    const signature = q.signature;
    const sandboxId = sandboxIdOf(req);
    if (typeof signature !== "string" || !signature || !sandboxId) throw unauthorized("send the sandbox's X-Access-Token, or a signed URL (signature) for /files");
    const rawExpiration = q.signature_expiration;
    let expiration: number | undefined;
    if (rawExpiration !== undefined) {
      if (typeof rawExpiration !== "string" || !/^\d{1,12}$/.test(rawExpiration)) throw unauthorized("invalid signature_expiration");
      expiration = Number(rawExpiration);
    }
    const path = typeof q.path === "string" ? q.path : "";
    const user = typeof q.username === "string" ? q.username : "";
    // HEAD answers what GET would (the file's size): a read. The acting user is the signed one: a Basic header may
    // not name another (it would take precedence over `username` in the route).
    const operation = req.method === "POST" ? "write" : "read";
    const basic = basicUserOf(req);
    if (basic !== undefined && basic !== user) throw unauthorized("the signature does not cover the user the Authorization header names");
    const signedBy = (ids: string[]) => ids.find((id) => sameText(fileUrlSignature(tokens.tokenOf(sandboxId, id), path, operation, user, expiration), signature));
    const keyId = signedBy(await activeKeyIds()) ?? signedBy(await activeKeyIds(250));
    if (keyId === undefined || !(await services.keys.isActive(keyId))) throw unauthorized("invalid signature");
    if (expiration !== undefined && expiration < Math.floor(Date.now() / 1000)) throw unauthorized("signature is already expired");
    return keyId;
  }

  app.setErrorHandler((err, req, reply) => {
    const isRpc = (req.routeOptions.config as { e2b?: string } | undefined)?.e2b === "envd" && /^\/[a-z]+\.[A-Za-z]+\//.test(req.url);
    if (isRpc) return sendUnaryError(reply, err);
    const isJupyter = (req.routeOptions.config as { e2b?: string } | undefined)?.e2b === "jupyter";
    const { status, body } = isJupyter ? jupyter.errorOf(err) : e2bError(err);
    // As Kiln's own handler: 503 `unavailable` (try again) is an expected refusal, logged at info.
    if (status >= 500 && !(err instanceof KilnError && err.code === "unavailable")) req.log.error({ err }, "request failed");
    else req.log.info({ code: status }, "request refused");
    return reply.code(status).type("application/json; charset=utf-8").send(body);
  });

  // After ready, so the websocket plugin's upgrade listener is among those it passes everything else to.
  app.addHook("onReady", (done) => {
    installPortProxy(app.server, { machines: services.machines, keyOf: envdKeyOf, onRevoked: services.keys.onRevoked, isKey: services.keys.isKey, servedPorts: [ENVD_PORT, JUPYTER_PORT], proto: new URL(opts.publicUrl).protocol.replace(":", ""), limits: opts.limits, remotePort: opts.remotePort });
    done();
  });

  const jupyter = await codeInterpreterRoutes(app, { services, sandboxIdOf: (req) => sandboxIdOf(req)! });
  await controlRoutes(app, { services, tokenOf: tokens.tokenOf, volumeTokenOf: tokens.volumeTokenOf, domain: publicDomain(opts.publicUrl) });
  await templateBuilderRoutes(app, { services, auth: opts.auth, secret, dataDir: opts.dataDir, publicUrl: opts.publicUrl, retentionS: opts.buildRetentionS ?? 604_800, maxBytes: app.initialConfig.bodyLimit ?? 1024 * 1024 });
  await envdRoutes(app, {
    services,
    processes,
    sandboxIdOf: (req) => sandboxIdOf(req)!,
    bodyLimit: app.initialConfig.bodyLimit ?? 1024 * 1024,
  });
}
