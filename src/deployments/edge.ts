// The deployment side of the public edge: the route table of services the edge may reach, signed public URLs,
// edge-token checks (with a bounded cache of verified tokens), and tunnels into a service's port.

import type { Socket } from "node:net";
import type { KeyObject } from "node:crypto";
import type { ServiceRow } from "../store/schema.ts";
import { KilnError } from "../errors.ts";
import type { MachineService } from "../machines/service.ts";
import { loadEdgeSecret, signEdgeToken, verifyEdgeToken } from "./edge-tokens.ts";

/** What the edge routes to for a service: its backing machine and port. */
export interface ServiceRoute {
  machineId: string;
  port: number;
}

/** Services the edge may route to: those starting, ready or unhealthy, kept from every service write. */
export class RouteTable {
  readonly #routes = new Map<string, ServiceRoute>();

  /** Keeps the table in step with a written service row. */
  track(row: ServiceRow): void {
    if (row.status === "starting" || row.status === "ready" || row.status === "unhealthy") this.#routes.set(row.id, { machineId: row.machine_id, port: row.port });
    else this.#routes.delete(row.id);
  }

  get(serviceId: string): ServiceRoute | undefined {
    return this.#routes.get(serviceId);
  }

  has(serviceId: string): boolean {
    return this.#routes.has(serviceId);
  }
}

/** Tokens already verified, with their expiry: a busy public URL pays for its HMAC once, not per request. */
class VerifiedTokens {
  static readonly MAX = 4096;
  readonly #tokens = new Map<string, { serviceId: string; expiresAtMs: number }>();

  /** The token's expiry if it was verified for this service and has not expired. */
  known(serviceId: string, token: string): number | undefined {
    const t = this.#tokens.get(token);
    return t && t.serviceId === serviceId && t.expiresAtMs > Date.now() ? t.expiresAtMs : undefined;
  }

  remember(serviceId: string, token: string, expiresAtMs: number): void {
    if (this.#tokens.size >= VerifiedTokens.MAX) this.#tokens.clear(); // a bound, not an LRU: re-verifying is cheap, memory growth is not
    this.#tokens.set(token, { serviceId, expiresAtMs });
  }
}

/** Where the edge drops a stopping service's kept-alive tunnels (the proxy registers itself). */
export interface TunnelOwner {
  drop(serviceId: string): void;
}

export class DeploymentEdge {
  readonly routes = new RouteTable();
  readonly #verified = new VerifiedTokens();
  readonly #machines: MachineService;
  readonly #opts: { publicUrl: string; edgeTokenTtlS: number };
  #secret: KeyObject | undefined;
  #proxy: TunnelOwner | undefined;

  /** `opts` is read on every use: the public URL may be set after start. */
  constructor(machines: MachineService, opts: { publicUrl: string; edgeTokenTtlS: number }) {
    this.#machines = machines;
    this.#opts = opts;
  }

  async load(dataDir: string): Promise<void> {
    this.#secret = await loadEdgeSecret(dataDir);
  }

  /** A fresh signed public URL for a ready service whose deployment allows one; null otherwise. */
  publicUrlOf(row: ServiceRow, allowed: boolean): string | null {
    if (!allowed || row.status !== "ready" || !row.machine_id || !this.#secret) return null;
    const token = signEdgeToken(this.#secret, row.id, Date.now() + this.#opts.edgeTokenTtlS * 1000);
    return `${this.#opts.publicUrl}/edge/${row.id}/?edge_token=${token}`;
  }

  /** Checks an edge token for a service; 401 for a wrong, expired or other service's token. Answers its expiry. */
  authorize(serviceId: string, token: string | undefined): number {
    const secret = this.#secret;
    if (!secret) throw new KilnError("unavailable", "The edge is not ready yet");
    if (!token) throw new KilnError("unauthorized", "This public URL needs its edge_token", { detail: { code: "unauthorized", phase: "edge" } });
    const known = this.#verified.known(serviceId, token);
    if (known !== undefined) return known;
    const check = verifyEdgeToken(secret, serviceId, token);
    if (!check.ok) {
      const why = check.reason === "expired" ? "The edge_token has expired: read the service again for a fresh public_url" : "The edge_token is not valid for this service";
      throw new KilnError("unauthorized", why, { detail: { code: "unauthorized", phase: "edge", details: { reason: check.reason } } });
    }
    this.#verified.remember(serviceId, token, check.expiresAtMs);
    return check.expiresAtMs;
  }

  /** A tunnel to a routable service's port inside its machine. */
  async openServicePort(serviceId: string): Promise<Socket> {
    const route = this.routes.get(serviceId);
    if (!route) throw new KilnError("unavailable", `Service ${serviceId} is not running`);
    const { agent } = await this.#machines.agentOf(route.machineId);
    try {
      return await agent.connectPort(route.port);
    } catch (err) {
      throw new KilnError("unavailable", `Service ${serviceId} does not answer on port ${route.port}`, { cause: err, detail: { retryable: true } });
    }
  }

  setProxy(p: TunnelOwner): void {
    this.#proxy = p;
  }

  /** Drops a stopping service's kept-alive tunnels. */
  dropTunnels(serviceId: string): void {
    this.#proxy?.drop(serviceId);
  }
}
