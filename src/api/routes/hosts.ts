// Hosts: the servers sharing this store, their status and capacity; draining one stops new machines going there.
// Any key lists and reads hosts; draining and activating take the operator's key (docs/hosts.md, docs/SECURITY.md).

import { Type } from "typebox";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { KilnError } from "../../errors.ts";
import { errors } from "../schemas.ts";
import { packLayer } from "../../hosts/layers/pack.ts";
import { LAYER_DIGEST } from "../../hosts/layers/service.ts";
import { isTunnelUpgrade, TUNNEL_PROTOCOL, TUNNEL_ROUTE } from "../../hosts/tunnel.ts";
import type { TunnelServer } from "../../hosts/tunnel.ts";
import type { FastifyRequest } from "fastify";
import type { Duplex } from "node:stream";

const tags = ["Hosts"];
const HostId = Type.String({ pattern: "^[A-Za-z0-9_.-]{1,64}$", description: "a host's id (KILN_HOST_ID, or made once per data dir)" });
const Params = Type.Object({ id: HostId });

const Capacity = Type.Object(
  {
    cores: Type.Integer(),
    memory_mb: Type.Integer(),
    mem_available_mb: Type.Integer(),
    min_free_memory_mb: Type.Integer(),
    free_disk_mb: Type.Union([Type.Integer(), Type.Null()]),
    min_free_disk_mb: Type.Integer(),
    max_disk_mb: Type.Integer(),
    live_machines: Type.Integer(),
    accepting: Type.Boolean({ description: "whether the host's admission floors let a create in at its last heartbeat" }),
    warm_ready: Type.Optional(
      Type.Record(Type.String(), Type.Integer(), {
        description: "booted machines its warm pools hold ready: `base` for the base template, a hot template's artifact id for its pool; placement prefers a host with one",
      }),
    ),
  },
  { description: "what the host's admission enforces, as of its last heartbeat" },
);

const Host = Type.Object({
  id: Type.String(),
  name: Type.String(),
  advertise_url: Type.String({ description: "where the other servers reach this host (KILN_ADVERTISE_URL)" }),
  status: Type.Union([Type.Literal("active"), Type.Literal("draining"), Type.Literal("lost")]),
  capacity: Capacity,
  heartbeat_at: Type.String(),
  started_at: Type.String(),
  created_at: Type.String(),
  lost_at: Type.Union([Type.String(), Type.Null()]),
  self: Type.Boolean({ description: "true for the host of the server that answered" }),
});

export async function hostRoutes(app: App, opts: { services: Services; tunnels: TunnelServer }) {
  const { hosts, keys } = opts.services;

  async function operatorOnly(keyId: string | undefined) {
    if (!(await keys.isOperator(keyId))) throw new KilnError("forbidden", "Draining and activating hosts takes the operator's key (KILN_API_KEY or the first-start key)");
  }

  app.get("/v1/hosts", { config: { auth: "key" }, schema: { tags, summary: "List the hosts sharing this store", response: { 200: Type.Object({ hosts: Type.Array(Host) }), ...errors() } } }, async () => ({
    hosts: await hosts.list(),
  }));
  app.get("/v1/hosts/:id", { config: { auth: "key" }, schema: { tags, summary: "Get a host", params: Params, response: { 200: Host, ...errors(404) } } }, async (req) => hosts.get(req.params.id));
  const actions = {
    drain: "Drain a host: no new machines go there; its machines keep running",
    activate: "Activate a drained host: new machines may go there again",
  } as const;
  // Templates travel: a peer fetches a layer this host holds, by its content digest, as a tar streamed from the
  // layer directory. Cluster authentication only (an API key is refused, 401); the fetcher checks the digest.
  app.get(
    "/v1/cluster/layers/:digest",
    { config: { auth: "cluster" }, schema: { hide: true, params: Type.Object({ digest: Type.String({ maxLength: 80 }) }) } },
    async (req, reply) => {
      if (!LAYER_DIGEST.test(req.params.digest)) throw new KilnError("invalid_request", "A layer is named by its sha256 digest (sha256:<64 hex>)");
      const held = await opts.services.layers?.served(req.params.digest);
      if (!held) throw new KilnError("not_found", `This host holds no layer ${req.params.digest}`);
      const abort = new AbortController();
      reply.raw.once("close", () => abort.abort());
      reply.header("content-type", "application/x-tar").header("content-length", String(held.bytes));
      return reply.send(packLayer(held.dir, abort.signal));
    },
  );
  // The port tunnel: a peer's edge or E2B port proxy reaching a port inside a machine this host runs (src/hosts/tunnel.ts).
  // Cluster authentication only, and only as an upgrade; registered before @fastify/websocket, which would otherwise
  // take the upgrade for a WebSocket handshake.
  app.get(
    TUNNEL_ROUTE,
    {
      config: { auth: "cluster" },
      schema: {
        hide: true,
        params: Type.Object({ id: Type.String({ maxLength: 64 }), port: Type.Integer({ minimum: 1, maximum: 65535 }) }),
        querystring: Type.Object({ use: Type.Union([Type.Literal("http"), Type.Literal("pipe")]) }),
      },
    },
    async (req, reply) => {
      const peer = upgradeParts(req);
      if (!peer || !isTunnelUpgrade(req.raw)) throw new KilnError("invalid_request", `A tunnel is opened as an upgrade (Upgrade: ${TUNNEL_PROTOCOL})`);
      const target = await opts.tunnels.connect(req.params.id, req.params.port);
      reply.hijack();
      if (peer.socket.destroyed) return void opts.tunnels.abandon(req.params.id, target);
      opts.tunnels.splice(req.params.id, req.query.use, peer.socket, peer.head, target);
    },
  );
  app.addHook("onClose", (_app, done) => {
    opts.tunnels.close();
    done();
  });
  for (const [action, summary] of Object.entries(actions) as [keyof typeof actions, string][]) {
    app.post(`/v1/hosts/:id/${action}`, { config: { auth: "key" }, schema: { tags, summary, params: Params, response: { 200: Host, ...errors(403, 404, 409) } } }, async (req) => {
      await operatorOnly(req.apiKeyId);
      return hosts[action](req.params.id);
    });
  }
}

/** The socket and head buffer @fastify/websocket kept for an upgrade request (undefined for a plain request). */
function upgradeParts(req: FastifyRequest): { socket: Duplex; head: Buffer } | undefined {
  const raw = req.raw as unknown as Record<symbol, unknown>;
  const symbols = Object.getOwnPropertySymbols(raw);
  const socket = raw[symbols.find((s) => s.description === "ws-socket")!] as Duplex | undefined;
  const head = raw[symbols.find((s) => s.description === "ws-head")!];
  return socket ? { socket, head: Buffer.isBuffer(head) ? head : Buffer.alloc(0) } : undefined;
}
