// The cluster's port tunnel: a byte stream from one server to a port inside a machine another host runs. The edge
// and E2B's port proxy answer on any server; when the machine is elsewhere they open this tunnel to its host instead
// of the guest agent's local one, and carry the request through it unchanged (their own proxy, bounds and credential
// checks stay on the first server). On the wire: `GET /v1/cluster/machines/{id}/ports/{port}/tunnel?use=http|pipe`
// with `Upgrade: kiln-tunnel`, signed with the cluster secret (auth kind `cluster`: no key opens it); the owner
// connects the agent's port, answers 101 and splices the two sockets byte for byte.

import { request as httpRequest } from "node:http";
import type { IncomingMessage } from "node:http";
import type { Socket } from "node:net";
import type { Duplex } from "node:stream";
import { ERROR_CATALOGUE, KilnError } from "../errors.ts";
import type { ErrorCode, ErrorDetail } from "../errors.ts";
import type { MachineService } from "../machines/service.ts";
import type { ProxyLimits } from "../deployments/proxy-limits.ts";
import type { ClusterAuth } from "./cluster-auth.ts";
import { CLUSTER_HEADERS } from "./cluster-auth.ts";
import type { Forwarder } from "./forward.ts";

export const TUNNEL_PROTOCOL = "kiln-tunnel";
export const TUNNEL_ROUTE = "/v1/cluster/machines/:id/ports/:port/tunnel";
/**
 * What a tunnel carries, which decides its idle bound on the owner: `http`, kept-alive requests of the first
 * server's proxy (that proxy bounds each request; a tunnel silent for its body idle bound is dead); `pipe`, an
 * upgraded connection (a WebSocket), which may stay quiet as long as a local one may, so only TCP keepalive watches it.
 */
export type TunnelUse = "http" | "pipe";
/** The largest error answer the client reads from an owner that refused a tunnel. */
const REFUSAL_MAX_BYTES = 16 * 1024;
/** How often TCP probes a quiet pipe tunnel, so a peer that vanished is noticed. */
const PIPE_KEEPALIVE_MS = 30_000;

/** Whether a raw request asks for a cluster tunnel (the server lets only these and WebSocket handshakes upgrade). */
export function isTunnelUpgrade(req: IncomingMessage): boolean {
  const upgrade = req.headers.upgrade;
  return typeof upgrade === "string" && upgrade.trim().toLowerCase() === TUNNEL_PROTOCOL && req.headers[CLUSTER_HEADERS.sig] !== undefined && (req.url ?? "").startsWith("/v1/cluster/");
}

/**
 * The first server's side: a socket to `port` inside `machineId` through its host, or undefined when the machine is
 * served here (this host's, unknown, or its host lost: the local path then answers as for a stopped machine).
 */
export function createTunnelClient(deps: { forwarder: Forwarder; auth: ClusterAuth; connectTimeoutMs: number }) {
  const { forwarder, auth } = deps;

  async function open(machineId: string, port: number, use: TunnelUse): Promise<Socket | undefined> {
    const host = await forwarder.ownerOf({ kind: "machines", id: machineId });
    if (!host) return undefined;
    const path = `/v1/cluster/machines/${encodeURIComponent(machineId)}/ports/${port}/tunnel?use=${use}`;
    const url = new URL(host.advertise_url);
    return new Promise<Socket>((resolve, reject) => {
      let settled = false;
      const settle = (fn: () => void) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        fn();
      };
      const unreachable = (why: string) =>
        new KilnError("unavailable", `The host running machine ${machineId} (${host.id}) could not be reached: ${why.slice(0, 200)}`, { detail: { retryable: true } });
      const req = httpRequest({
        host: url.hostname,
        port: url.port || 80,
        method: "GET",
        path,
        agent: false,
        headers: { connection: "Upgrade", upgrade: TUNNEL_PROTOCOL, ...auth.sign("GET", path, host.id, undefined) },
      });
      const timer = setTimeout(() => {
        req.destroy();
        settle(() => reject(unreachable(`no tunnel within ${deps.connectTimeoutMs / 1000} s`)));
      }, deps.connectTimeoutMs);
      req.on("error", (err) => settle(() => reject(unreachable(err.message))));
      req.on("upgrade", (res, socket, head) => {
        if (res.statusCode !== 101 || String(res.headers.upgrade).toLowerCase() !== TUNNEL_PROTOCOL) {
          socket.destroy();
          return settle(() => reject(unreachable(`answered ${res.statusCode} to a tunnel`)));
        }
        // Too late (the timer already refused): nobody holds this socket.
        if (settled) return void socket.destroy();
        if (head.length) socket.unshift(head);
        socket.setNoDelay(true);
        settle(() => resolve(socket));
      });
      req.on("response", (res) => {
        // The owner refused: its error (a stopped machine, a closed port, a full share) is the caller's answer.
        const chunks: Buffer[] = [];
        let size = 0;
        res.on("data", (c: Buffer) => {
          size += c.length;
          if (size <= REFUSAL_MAX_BYTES) chunks.push(c);
          else res.destroy();
        });
        res.on("close", () => settle(() => reject(refusalOf(res.statusCode ?? 502, Buffer.concat(chunks).toString("utf8"), unreachable))));
      });
      req.end();
    });
  }

  return { open };
}

export type TunnelClient = ReturnType<typeof createTunnelClient>;
/** What the edge and the port proxy ask: a socket through the machine's host, or undefined to serve it here. */
export type RemotePort = (machineId: string, port: number, use: TunnelUse) => Promise<Socket | undefined>;

/** An owner's error envelope as the KilnError it was there (unknown codes and unreadable bodies: unreachable). */
function refusalOf(status: number, text: string, unreachable: (why: string) => KilnError): KilnError {
  try {
    const body = JSON.parse(text) as { error?: unknown; code?: unknown; error_detail?: ErrorDetail };
    if (typeof body.code === "string" && body.code in ERROR_CATALOGUE && typeof body.error === "string") {
      const detail = body.error_detail ? { ...body.error_detail } : undefined;
      if (detail) delete (detail as Record<string, unknown>).request_id;
      return new KilnError(body.code as ErrorCode, body.error, { detail });
    }
  } catch {
    // not an envelope
  }
  return unreachable(`answered ${status} to a tunnel`);
}

/**
 * The owner's side: opens the machine's port through its guest agent and splices it to the peer's socket. Bounded:
 * the port's connect (the agent's own bound, and `connectTimeoutMs`), tunnels per machine (the most one server's
 * proxy opens to one upstream: its kept-alive connections and its upgrades), and an idle bound for `http` tunnels.
 */
export function createTunnelServer(deps: { machines: MachineService; limits: ProxyLimits }) {
  const { limits } = deps;
  const perMachine = new Map<string, number>();
  const open = new Set<Duplex>();
  const cap = limits.connections + limits.upgrades;

  /**
   * Connects the port, counted against the machine's share from then on (release it with `splice`'s end or
   * `abandon`); throws the refusal (nothing written yet, nothing counted) as the local paths would.
   */
  async function connect(machineId: string, port: number): Promise<Socket> {
    if ((perMachine.get(machineId) ?? 0) >= cap) {
      throw new KilnError("unavailable", `Machine ${machineId} has ${cap} tunnels open from other hosts: try again shortly`, { detail: { retryable: true } });
    }
    perMachine.set(machineId, (perMachine.get(machineId) ?? 0) + 1);
    try {
      const { agent } = await deps.machines.agentOf(machineId);
      try {
        return await agent.connectPort(port, limits.connectTimeoutMs);
      } catch (err) {
        const status = (err as { status?: number }).status;
        const message = (err as Error).message ?? "the port is not reachable";
        // As the port proxy's own mapping: nothing listening is final (502), anything else worth retrying (503).
        throw new KilnError("unavailable", message, { detail: { retryable: !(status === 502 || status === 404) } });
      }
    } catch (err) {
      release(machineId);
      throw err;
    }
  }

  function release(machineId: string) {
    const n = (perMachine.get(machineId) ?? 1) - 1;
    if (n > 0) perMachine.set(machineId, n);
    else perMachine.delete(machineId);
  }

  /** A connected port whose peer went away before the 101. */
  function abandon(machineId: string, target: Socket): void {
    target.destroy();
    release(machineId);
  }

  /** After `connect`: the 101, then both ways byte for byte until either side ends. */
  function splice(machineId: string, use: TunnelUse, peer: Duplex, head: Buffer, target: Socket): void {
    open.add(peer);
    let ended = false;
    const end = () => {
      if (ended) return;
      ended = true;
      open.delete(peer);
      release(machineId);
      target.destroy();
      peer.destroy();
    };
    const socket = peer as Socket;
    socket.setNoDelay?.(true);
    if (use === "http") {
      socket.setTimeout?.(limits.idleTimeoutMs, end);
    } else {
      socket.setTimeout?.(0);
      socket.setKeepAlive?.(true, PIPE_KEEPALIVE_MS);
    }
    peer.write(`HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: ${TUNNEL_PROTOCOL}\r\n\r\n`);
    if (head.length) target.write(head);
    target.pipe(peer);
    peer.pipe(target);
    for (const s of [target, peer]) s.on("error", end).once("close", end);
  }

  /** Tunnels open on one machine (tests and diagnostics). */
  function count(machineId: string): number {
    return perMachine.get(machineId) ?? 0;
  }

  function close() {
    for (const s of [...open]) s.destroy();
  }

  return { connect, splice, abandon, count, close };
}

export type TunnelServer = ReturnType<typeof createTunnelServer>;
