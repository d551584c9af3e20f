// The cluster's hooks on the HTTP server: after authentication (the matched route decided who the caller is), a
// machine-bound request whose machine runs on another host is forwarded there, and a create is placed on a host
// and forwarded when that host is another. A request that came from a peer is always served here, never forwarded on.

import type { App } from "../api/app-type.ts";
import { KilnError } from "../errors.ts";
import type { HostRow } from "../store/schema.ts";
import type { FastifyReply, FastifyRequest } from "fastify";
import type { Bound, Forwarder } from "./forward.ts";
import { boundTo } from "./forward.ts";
import type { Placement } from "./placement.ts";
import { routeConfigOf } from "../api/route-config.ts";

/** A create body placement may hold to try another host; creates are small JSON documents. */
const CREATE_BODY_MAX = 1024 * 1024;
/** The create routes placement chooses a host for: Kiln's and E2B's. */
const PLACED_CREATES = new Set(["/v1/machines", "/sandboxes", "/v2/sandboxes"]);

/**
 * What a layer outside /v1 (E2B's) says a request is bound to; asked after Kiln's own routes' rule. A promise when
 * the answer is in the store (E2B's requested template builds).
 */
export type BoundOf = (req: FastifyRequest) => Bound | undefined | Promise<Bound | undefined>;

export function installClusterRouting(
  app: App,
  deps: {
    hostId: string;
    forwarder: Forwarder;
    placement: Placement;
    boundOf?: BoundOf;
    locality?: (templateRef: string | undefined) => Promise<{ holders?: Set<string>; warm?: string }>;
    /** This host's status as the store says it now (a peer placing a create may have read an older one). */
    ownStatus?: () => Promise<string | undefined>;
  },
) {
  const { forwarder, placement, hostId } = deps;

  app.addHook("onRequest", (req, reply, done) => {
    const route = routeConfigOf(req);
    if (route.url === undefined || req.forwardedBy !== undefined) return done();
    const bound = boundTo(req.method, route.url, req.params as Record<string, string | undefined>) ?? deps.boundOf?.(req);
    if (!bound) return done();
    const owner = bound instanceof Promise ? bound.then((b) => (b ? forwarder.ownerOf(b) : undefined)) : forwarder.ownerOf(bound);
    owner.then(
      (host) => {
        if (!host) return done();
        const target = { id: host.id, url: host.advertise_url };
        if (req.headers.upgrade) return forwarder.forwardUpgrade(req, reply, target);
        forwarder.forwardHttp(req, reply, target).catch((err: Error) => {
          // Nothing was written yet (forwardHttp throws only before the answer starts): the envelope goes out.
          if (!reply.sent) return reply.send(err);
          req.log.warn({ err }, "forwarding failed after the answer started");
        });
      },
      (err: Error) => done(err),
    );
  });

  // Placement sees the parsed body (before validation), so it can send the same create to another host if the first
  // refuses for now (503); the chosen host validates and admits it as any create. Kiln's create and E2B's. Only those
  // routes carry the hook: an async hook on every route costs every request a promise.
  app.addHook("onRoute", (route) => {
    const methods = Array.isArray(route.method) ? route.method : [route.method];
    if (!methods.includes("POST") || !PLACED_CREATES.has(route.url)) return;
    const own = route.preValidation;
    route.preValidation = [place, ...(own === undefined ? [] : Array.isArray(own) ? own : [own])]; // first, as an app-wide hook ran
  });
  async function place(req: FastifyRequest, reply: FastifyReply) {
    if (req.method !== "POST") return;
    const url = routeConfigOf(req).url;
    const affinity = url === "/v1/machines" ? nativeAffinity : url === "/sandboxes" || url === "/v2/sandboxes" ? e2bAffinity : undefined;
    if (!affinity) return;
    if (req.forwardedBy !== undefined) {
      // Placed here by a peer whose view of the hosts may be a heartbeat old: a draining host takes no new machines, and
      // its 503 sends the peer on to the next host.
      const status = await deps.ownStatus?.();
      if (status !== undefined && status !== "active") throw new KilnError("unavailable", `This host is ${status}: it takes no new machines`, { detail: { retryable: true } });
      return;
    }
    const want = (req.body ?? {}) as Record<string, unknown>;
    const fixed = await affinity(want);
    if (fixed !== undefined) {
      if (fixed === "here" || fixed.id === hostId) return;
      await forwarder.forwardHttp(req, reply, { id: fixed.id, url: fixed.advertise_url }, { body: Buffer.from(JSON.stringify(want)) });
      return reply;
    }
    // Template locality: hosts that already hold the template's layers first (the others fetch them if chosen), then
    // those with a warm machine ready for it.
    const template = url === "/v1/machines" ? want.template : want.templateID;
    const { holders, warm } = (await deps.locality?.(typeof template === "string" ? template : undefined)) ?? {};
    const hosts = await placement.candidates(holders, warm);
    if (hosts.length === 0) throw new KilnError("unavailable", "No active host can take a machine now (all are draining, lost or under their admission floors); try again later", { detail: { retryable: true } });
    let body: Buffer | undefined;
    for (const host of hosts) {
      if (host.id === hostId) {
        // Served here, by the route (which judges the body as any create); counted until answered, so a burst of
        // creates through this server sees the ones it is making here too and spreads across hosts.
        reply.raw.once("close", placement.hold(hostId));
        return;
      }
      // Only a create sent on is held here whole; what is too large for that is the route's to refuse as it would.
      body ??= Buffer.from(JSON.stringify(want));
      if (body.length > CREATE_BODY_MAX) return;
      const release = placement.hold(host.id);
      try {
        const relayed = await forwarder.forwardHttp(req, reply, { id: host.id, url: host.advertise_url }, { body, accept: (status) => status !== 503 });
        if (relayed) return reply;
      } finally {
        release();
      }
      req.log.info({ host_id: host.id }, "a host refused a create for now (503 or unreachable); placing it on the next");
    }
    throw new KilnError("unavailable", "Every active host refused the create for now (503); try again later", { detail: { retryable: true } });
  }

  /**
   * Where a create must go whatever the capacities, if anywhere: a machine from a snapshot goes where the snapshot's
   * files are, one that mounts volumes where their data is (the first volume's host; that host's own check refuses
   * volumes of another host). "here": serve it on this server; undefined: place it.
   */
  async function nativeAffinity(want: Record<string, unknown>): Promise<HostRow | "here" | undefined> {
    if (Array.isArray(want.volumes) && want.volumes.length > 0) {
      const volumeId = (want.volumes[0] as { volume_id?: unknown } | undefined)?.volume_id;
      return (typeof volumeId === "string" ? await placement.volumeHost(volumeId) : undefined) ?? "here";
    }
    if (typeof want.snapshot === "string") return (await placement.snapshotHost(want.snapshot)) ?? "here";
    return undefined;
  }

  /**
   * E2B's create: a snapshot's id as templateID goes where its files are; one with volumeMounts (volumes named as the
   * layer resolves them) is served here, whose volumes check refuses another host's.
   */
  async function e2bAffinity(want: Record<string, unknown>): Promise<HostRow | "here" | undefined> {
    if (Array.isArray(want.volumeMounts) && want.volumeMounts.length > 0) return "here";
    const template = want.templateID;
    if (typeof template === "string" && template.startsWith("snp_")) return (await placement.snapshotHost(template)) ?? "here";
    return undefined;
  }
}
