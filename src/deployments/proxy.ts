// The edge data path: HTTP requests and WebSocket upgrades forwarded to a service's port through the guest agent's
// port tunnel. Bodies stream both ways (nothing is buffered whole); tunnels are kept alive per service and reused.

import { Agent, request as httpRequest } from "node:http";
import type { IncomingHttpHeaders, IncomingMessage, OutgoingHttpHeaders } from "node:http";
import type { Duplex } from "node:stream";
import type { Socket } from "node:net";

/** Headers that belong to one hop and never cross the proxy. */
const HOP_BY_HOP = new Set(["connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"]);

/** An http.Agent whose connections are tunnels into the machine (callback form of createConnection). */
class TunnelAgent extends Agent {
  private readonly open: () => Promise<Socket>;
  constructor(open: () => Promise<Socket>) {
    super({ keepAlive: true, maxSockets: 64, maxFreeSockets: 16, timeout: 60_000 });
    this.open = open;
  }
  override createConnection(_options: unknown, callback?: (err: Error | null, stream: Duplex) => void): Duplex | undefined {
    this.open().then(
      (s) => callback?.(null, s),
      (err: Error) => callback?.(err, undefined as unknown as Duplex),
    );
    return undefined;
  }
}

export interface ForwardRequest {
  method: string;
  /** Path and query as the service should see them (the /edge/<id> prefix and the token removed). */
  path: string;
  headers: OutgoingHttpHeaders;
  body: IncomingMessage | undefined;
}

export function createEdgeProxy(open: (serviceId: string) => Promise<Socket>) {
  const agents = new Map<string, TunnelAgent>();

  function agentFor(serviceId: string): TunnelAgent {
    let agent = agents.get(serviceId);
    if (!agent) {
      agent = new TunnelAgent(() => open(serviceId));
      agents.set(serviceId, agent);
    }
    return agent;
  }

  /** Sends the request and resolves with the service's response head; its body is the returned stream. */
  function forward(serviceId: string, req: ForwardRequest): Promise<IncomingMessage> {
    return new Promise((resolve, reject) => {
      const upstream = httpRequest({ agent: agentFor(serviceId), method: req.method, path: req.path, headers: req.headers });
      upstream.once("response", resolve);
      upstream.once("error", reject);
      if (req.body) {
        req.body.pipe(upstream);
        req.body.once("error", () => upstream.destroy());
      } else upstream.end();
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
    agents.get(serviceId)?.destroy();
    agents.delete(serviceId);
  }

  function close() {
    for (const a of agents.values()) a.destroy();
    agents.clear();
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
