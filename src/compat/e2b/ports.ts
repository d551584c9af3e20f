// `sandbox.getHost(port)` reached through Kiln: a request whose Host is `<port>-<sandbox id>.<domain>` (any port
// but envd's) goes, HTTP or WebSocket, to that port inside the machine through the guest agent's tunnel, on the
// edge's proxy (the same shares, timeouts, credential rules and WebSocket-only upgrades as public URLs).
// It is taken off the HTTP server before Fastify routes it: its path belongs to the machine's server, not to Kiln.

import type { IncomingMessage, Server, ServerResponse } from "node:http";
import type { Duplex } from "node:stream";
import type { MachineService } from "../../machines/service.ts";
import { KilnError } from "../../errors.ts";
import { hasClusterHeaders } from "../../hosts/cluster-auth.ts";
import { acceptWebSocket, createUpstreamProxy, DEFAULT_PROXY_LIMITS, forwardedHeaders, isWebSocketUpgrade } from "../../deployments/proxy.ts";
import type { ProxyLimits } from "../../deployments/proxy.ts";
import { rememberedCheck, stripKilnCredentials } from "../../deployments/credentials.ts";
import { machineIdOf, SANDBOX_ID_SOURCE } from "./ids.ts";
import type { RemotePort } from "../../hosts/tunnel.ts";

/** The machine port a request is for (`sandboxId`: the machine's id), or undefined (the ports Kiln serves itself — envd's, the code interpreter's — and Kiln's own names are not port requests). */
export function portTargetOf(host: string | undefined, servedPorts: readonly number[]): { port: number; sandboxId: string } | undefined {
  const m = host ? SANDBOX_HOST_RE.exec(host) : null;
  if (!m) return undefined;
  const port = Number(m[1]);
  if (servedPorts.includes(port) || port < 1 || port > 65535) return undefined;
  return { port, sandboxId: machineIdOf(m[2])! };
}

/**
 * Only a sandbox id (or the machine id it stands for) makes a Host a sandbox's, so a Kiln host that happens to start
 * `<digits>-` stays Kiln's. Group 2 is the id as written: machineIdOf turns it into the machine's.
 */
export const SANDBOX_HOST_RE = new RegExp(`^(\\d{1,5})-((?:mch_)?${SANDBOX_ID_SOURCE})\\.`);

/**
 * The Host a request was sent to: its own, or for a request another server of the cluster forwarded (it carries the
 * cluster's headers, which the auth hook verifies before anything is served, and refuses if forged), the Host the
 * caller used there (`x-forwarded-host`, set by the forwarder), which names the sandbox and port.
 */
export function requestHost(req: { headers: Record<string, string | string[] | undefined> }): string | undefined {
  const forwarded = req.headers["x-forwarded-host"];
  if (typeof forwarded === "string" && hasClusterHeaders(req.headers)) return forwarded;
  const host = req.headers.host;
  return typeof host === "string" ? host : undefined;
}

export interface PortProxyDeps {
  machines: MachineService;
  /** The key a token was issued to when it is this sandbox's access token and that key is active, else undefined. */
  keyOf: (sandboxId: string, token: unknown) => Promise<string | undefined>;
  /** Calls `fn` with the ids of keys revoked since (anywhere on the store): their requests and pipes are cut. */
  onRevoked: (fn: (ids: string[]) => void) => void;
  /** Whether a string is one of Kiln's API keys (revoked or not): such a key never reaches the sandbox's server. */
  isKey: (candidate: string) => Promise<boolean>;
  /** Sandbox ports Kiln answers itself (envd, the code interpreter): never proxied into the machine. */
  servedPorts: readonly number[];
  proto: string;
  limits?: ProxyLimits;
  /** A sandbox port on another host, through the cluster tunnel; undefined when the sandbox is served here. */
  remotePort?: RemotePort;
}

export function installPortProxy(server: Server, deps: PortProxyDeps) {
  const isKilnKey = rememberedCheck(deps.isKey);
  // One upstream per sandbox port, keyed `<sandbox id>:<port>`.
  const proxy = createUpstreamProxy(async (key, use) => {
    const [sandboxId, port] = key.split(":");
    // A sandbox another host runs: its errors are already the port's (a closed port 502, a stopped sandbox 409).
    const remote = await deps.remotePort?.(sandboxId, Number(port), use);
    if (remote) return remote;
    const { agent } = await deps.machines.agentOf(sandboxId);
    return agent.connectPort(Number(port)).catch((err: { status?: number; message?: string }) => {
      throw err?.status === 502 || err?.status === 404
        ? new KilnError("unavailable", err?.message ?? "nothing is listening on that port", { detail: { retryable: false } })
        : new KilnError("machine_not_running", err?.message ?? "the port is not reachable");
    });
  }, deps.limits ?? DEFAULT_PROXY_LIMITS);
  server.once("close", () => proxy.close());

  /** Requests in flight and upgraded pipes, by the key whose token opened them: a revoked key's are cut at once. */
  const live = new Map<string, Set<() => void>>();
  function hold(keyId: string, cut: () => void, closed: NodeJS.EventEmitter) {
    let held = live.get(keyId);
    if (!held) live.set(keyId, (held = new Set()));
    held.add(cut);
    closed.once("close", () => {
      held.delete(cut);
      if (held.size === 0 && live.get(keyId) === held) live.delete(keyId);
    });
  }
  deps.onRevoked((ids) => {
    for (const id of ids) {
      const held = live.get(id);
      live.delete(id);
      for (const cut of held ?? []) cut();
    }
  });

  /** The sandbox port, once the request carries that sandbox's token (E2B's `e2b-traffic-access-token`, or envd's header). */
  async function authorize(req: IncomingMessage) {
    const target = portTargetOf(req.headers.host, deps.servedPorts)!;
    const token = req.headers["e2b-traffic-access-token"] ?? req.headers["x-access-token"];
    const keyId = await deps.keyOf(target.sandboxId, token);
    if (keyId === undefined) throw new KilnError("unauthorized", "send the sandbox's access token in e2b-traffic-access-token");
    return { ...target, keyId };
  }

  /** What crosses into the sandbox: hop-by-hop headers, the sandbox's token and any Kiln key stay out. */
  async function headersFor(req: IncomingMessage, sandboxId: string, keepUpgrade: boolean) {
    const headers = forwardedHeaders(req.headers, { clientIp: req.socket.remoteAddress, proto: deps.proto, keepUpgrade });
    await stripKilnCredentials(headers, async (c) => (await deps.keyOf(sandboxId, c)) !== undefined || isKilnKey(c));
    return headers;
  }

  /** E2B's answers for what Kiln refuses: 502 when nothing listens, 503 busy, 504 no answer in time. */
  function statusOf(err: unknown): { status: number; message: string } {
    const e = err instanceof KilnError ? err : new KilnError("unavailable", "the port could not be reached", { detail: { retryable: false } });
    const status = e.code === "unavailable" ? (e.detail?.retryable ? 503 : 502) : e.status;
    return { status, message: e.code === "internal" ? "Internal error" : e.message };
  }

  function refuse(res: ServerResponse, err: unknown) {
    const { status, message } = statusOf(err);
    if (res.headersSent) return void res.destroy();
    res.writeHead(status, { "content-type": "application/json" });
    res.end(JSON.stringify({ code: status, message }));
  }

  async function proxyHttp(req: IncomingMessage, res: ServerResponse) {
    const target = await authorize(req);
    hold(target.keyId, () => res.destroy(), res);
    const headers = await headersFor(req, target.sandboxId, false);
    await proxy.forward(`${target.sandboxId}:${target.port}`, { method: req.method ?? "GET", path: req.url ?? "/", headers, body: req.method === "GET" || req.method === "HEAD" ? undefined : req }, res, () => ({}));
  }

  async function proxyUpgrade(req: IncomingMessage, client: Duplex, head: Buffer) {
    // The server only emits upgrades that are WebSocket handshakes (see server.ts); checked again, as the edge does.
    if (!isWebSocketUpgrade(req)) throw new KilnError("invalid_request", "only WebSocket upgrades are carried to a sandbox's port");
    const target = await authorize(req);
    hold(target.keyId, () => client.destroy(), client);
    const headers = await headersFor(req, target.sandboxId, true);
    await proxy.upgrade(`${target.sandboxId}:${target.port}`, { method: req.method ?? "GET", path: req.url ?? "/", headers }, client, head, { accept: acceptWebSocket });
  }

  // Fastify's own listeners run for everything else, exactly as before.
  for (const event of ["request", "upgrade"] as const) {
    const previous = server.listeners(event) as ((...args: unknown[]) => void)[];
    server.removeAllListeners(event);
    server.on(event, (...args: unknown[]) => {
      const req = args[0] as IncomingMessage;
      if (portTargetOf(req.headers.host, deps.servedPorts)) {
        if (event === "request") {
          const res = args[1] as ServerResponse;
          return void proxyHttp(req, res).catch((err: unknown) => {
            req.resume(); // an unread body must not hold the connection
            refuse(res, err);
          });
        }
        const client = args[1] as Duplex;
        client.on("error", () => undefined);
        return void proxyUpgrade(req, client, args[2] as Buffer).catch((err: unknown) => {
          const { status } = statusOf(err);
          client.end(`HTTP/1.1 ${status} Refused\r\nconnection: close\r\ncontent-length: 0\r\n\r\n`);
        });
      }
      for (const l of previous) l(...args);
    });
  }
}
