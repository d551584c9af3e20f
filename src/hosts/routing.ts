// The cluster's hooks on the HTTP server: after authentication (the matched route decided who the caller is), a
// machine-bound request whose machine runs on another host is forwarded there, and a create is placed on a host
// and forwarded when that host is another. A request that came from a peer is always served here, never forwarded on.

import type { App } from "../api/app-type.ts";
import { KilnError } from "../errors.ts";
import type { Forwarder } from "./forward.ts";
import { boundTo } from "./forward.ts";
import type { Placement } from "./placement.ts";

/** A create body placement may hold to try another host; creates are small JSON documents. */
const CREATE_BODY_MAX = 1024 * 1024;

export function installClusterRouting(app: App, deps: { hostId: string; forwarder: Forwarder; placement: Placement; locality?: (templateRef: string | undefined) => Promise<Set<string> | undefined> }) {
  const { forwarder, placement, hostId } = deps;

  app.addHook("onRequest", (req, reply, done) => {
    if (req.is404 || req.forwardedBy !== undefined) return done();
    const bound = boundTo(req.method, req.routeOptions.url, req.params as Record<string, string | undefined>);
    if (!bound) return done();
    forwarder.ownerOf(bound).then(
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
  // refuses for now (503); the chosen host validates and admits it as any create.
  app.addHook("preValidation", async (req, reply) => {
    if (req.forwardedBy !== undefined || req.method !== "POST" || req.routeOptions.url !== "/v1/machines") return;
    const want = (req.body ?? {}) as { snapshot?: unknown; volumes?: unknown[]; template?: unknown };
    // Affinity: a machine from a snapshot goes where the snapshot's files are, one that mounts volumes where their
    // data is (the first volume's host; that host's own check refuses volumes of another host).
    const volumeId = Array.isArray(want.volumes) ? (want.volumes[0] as { volume_id?: unknown } | undefined)?.volume_id : undefined;
    if (Array.isArray(want.volumes) && want.volumes.length > 0) {
      const host = typeof volumeId === "string" ? await placement.volumeHost(volumeId) : undefined;
      if (!host || host.id === hostId) return;
      await forwarder.forwardHttp(req, reply, { id: host.id, url: host.advertise_url }, { body: Buffer.from(JSON.stringify(want)) });
      return reply;
    }
    if (typeof want.snapshot === "string") {
      const host = await placement.snapshotHost(want.snapshot);
      if (!host || host.id === hostId) return;
      await forwarder.forwardHttp(req, reply, { id: host.id, url: host.advertise_url }, { body: Buffer.from(JSON.stringify(want)) });
      return reply;
    }
    // Template locality: hosts that already hold the template's layers first; the others fetch them if chosen.
    const holders = await deps.locality?.(typeof want.template === "string" ? want.template : undefined);
    const hosts = await placement.candidates(holders);
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
      body ??= Buffer.from(JSON.stringify(req.body ?? {}));
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
  });
}
