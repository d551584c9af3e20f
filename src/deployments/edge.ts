// The deployment side of the public edge: the route table of services the edge may reach, each deployment's access
// (token, public or signed), public URLs, edge-token checks (with a bounded cache of verified signed tokens), and
// tunnels into a service's port. `/edge/<service id>/` names one replica; `/edge/<deployment id>/` any routable
// replica of the deployment (ready ones first, in turn), so it outlives rollouts and restarts.

import type { Socket } from "node:net";
import type { KeyObject } from "node:crypto";
import type { Db, DeploymentRow, ServiceRow } from "../store/schema.ts";
import { KilnError } from "../errors.ts";
import type { MachineService } from "../machines/service.ts";
import { loadStoreEdgeSecret, sameToken, signEdgeToken, stableEdgeToken, verifyEdgeToken } from "./edge-tokens.ts";
import type { AccessMode } from "./schemas.ts";
import { edgeOriginOf } from "./edge-origin.ts";
import type { EdgeDomain } from "./edge-origin.ts";
import type { RemotePort, TunnelUse } from "../hosts/tunnel.ts";

/** What the edge routes to for a service: its backing machine and port, its deployment and status. */
export interface ServiceRoute {
  machineId: string;
  port: number;
  deploymentId: string;
  ready: boolean;
}

/** Services the edge may route to: those starting, ready or unhealthy, kept from every service write. */
export class RouteTable {
  readonly #routes = new Map<string, ServiceRoute>();
  readonly #byDeployment = new Map<string, Set<string>>();
  #turn = 0;

  /** Keeps the table in step with a written service row. */
  track(row: ServiceRow): void {
    if (row.status === "starting" || row.status === "ready" || row.status === "unhealthy") {
      this.#routes.set(row.id, { machineId: row.machine_id, port: row.port, deploymentId: row.deployment_id, ready: row.status === "ready" });
      let set = this.#byDeployment.get(row.deployment_id);
      if (!set) this.#byDeployment.set(row.deployment_id, (set = new Set()));
      set.add(row.id);
    } else {
      this.#routes.delete(row.id);
      const set = this.#byDeployment.get(row.deployment_id);
      set?.delete(row.id);
      if (set?.size === 0) this.#byDeployment.delete(row.deployment_id);
    }
  }

  get(serviceId: string): ServiceRoute | undefined {
    return this.#routes.get(serviceId);
  }

  has(serviceId: string): boolean {
    return this.#routes.has(serviceId);
  }

  /** A routable replica of a deployment on this server: the ready ones in turn, else any (riding out an unhealthy spell). */
  pick(deploymentId: string): string | undefined {
    const set = this.#byDeployment.get(deploymentId);
    if (!set || set.size === 0) return undefined;
    const ids = [...set];
    const ready = ids.filter((id) => this.#routes.get(id)?.ready);
    const from = ready.length > 0 ? ready : ids;
    return from[this.#turn++ % from.length];
  }
}

/** What the edge knows of a deployment's access: kept from every deployment write (and the store's, see poll). */
interface Access {
  /** Deployments that give no public URL (public_url false, deleting, deleted) have no entry. */
  mode: AccessMode;
  salt: string;
  /** The expected `token` credential, kept in memory only. */
  token: Buffer | undefined;
}

/** Who the edge lets through, and to where. `expiresAtMs` is when the credential ends (undefined: it does not). */
export interface EdgeGrant {
  serviceId: string;
  deploymentId: string | undefined;
  mode: AccessMode;
  expiresAtMs: number | undefined;
}

/** Tokens already verified, with their expiry: a busy public URL pays for its HMAC once, not per request. */
class VerifiedTokens {
  static readonly MAX = 4096;
  readonly #tokens = new Map<string, { serviceId: string; salt: string; expiresAtMs: number }>();

  /** The token's expiry if it was verified for this service under this salt (not rotated since) and has not expired. */
  known(serviceId: string, salt: string, token: string): number | undefined {
    const t = this.#tokens.get(token);
    return t && t.serviceId === serviceId && t.salt === salt && t.expiresAtMs > Date.now() ? t.expiresAtMs : undefined;
  }

  remember(serviceId: string, salt: string, token: string, expiresAtMs: number): void {
    if (this.#tokens.size >= VerifiedTokens.MAX) this.#tokens.clear(); // a bound, not an LRU: re-verifying is cheap, memory growth is not
    this.#tokens.set(token, { serviceId, salt, expiresAtMs });
  }
}

/** Where the edge drops a stopping service's kept-alive tunnels (the proxy registers itself). */
export interface TunnelOwner {
  drop(serviceId: string): void;
}

/** Where public URLs point: KILN_PUBLIC_URL (and /edge/<id>/), or with KILN_EDGE_DOMAIN an origin per deployment. */
export interface EdgeOptions {
  publicUrl: string;
  edgeTokenTtlS: number;
  edgeDomain?: EdgeDomain;
}

export class DeploymentEdge {
  readonly routes = new RouteTable();
  readonly #verified = new VerifiedTokens();
  readonly #access = new Map<string, Access>();
  readonly #seenAt = new Map<string, string>();
  readonly #accessChanged = new Set<(deploymentId: string) => void>();
  readonly #machines: MachineService;
  readonly #opts: EdgeOptions;
  #secret: KeyObject | undefined;
  #proxy: TunnelOwner | undefined;
  #remotePort: RemotePort | undefined;

  /** `opts` is read on every use: the public URL may be set after start. */
  constructor(machines: MachineService, opts: EdgeOptions) {
    this.#machines = machines;
    this.#opts = opts;
  }

  async load(db: Db, dataDir: string): Promise<void> {
    this.#secret = await loadStoreEdgeSecret(db, dataDir);
  }

  /**
   * Keeps a deployment's access in step with its row (every write of one, and the store's poll). A change of mode,
   * token or availability tells the listeners (the edge cuts that deployment's open WebSockets).
   */
  setAccess(row: Pick<DeploymentRow, "id" | "status" | "public_url" | "access" | "edge_salt" | "updated_at">): void {
    // A poll that read the row before a local write lands after it: an older row never undoes a newer one.
    const seen = this.#seenAt.get(row.id);
    if (seen !== undefined && row.updated_at < seen) return;
    this.#seenAt.set(row.id, row.updated_at);
    const mode = row.status === "active" && row.public_url === 1 ? (row.access as AccessMode) : null;
    const before = this.#access.get(row.id);
    if (before && before.mode === mode && before.salt === row.edge_salt) return;
    if (!before && mode === null) return;
    if (mode === null) this.#access.delete(row.id);
    else this.#access.set(row.id, { mode, salt: row.edge_salt, token: undefined });
    if (before) for (const fn of this.#accessChanged) fn(row.id);
  }

  /** Calls `fn` with a deployment whose access changed (rotated, another mode, no public URL, deleted). */
  onAccessChanged(fn: (deploymentId: string) => void): void {
    this.#accessChanged.add(fn);
  }

  /** The `token` credential of a deployment, made once from its salt and kept in memory only. */
  #tokenOf(deploymentId: string, a: Access, secret: KeyObject): Buffer {
    return (a.token ??= Buffer.from(stableEdgeToken(secret, deploymentId, a.salt)));
  }

  /** The query the public URLs of a deployment carry: its token, a fresh signed one for `serviceId`, or none. */
  #credential(deploymentId: string, serviceId: string | undefined): string | null {
    const a = this.#access.get(deploymentId);
    if (!a || !this.#secret) return null;
    if (a.mode === "public") return "";
    if (a.mode === "token") return `?edge_token=${this.#tokenOf(deploymentId, a, this.#secret).toString()}`;
    return serviceId ? `?edge_token=${signEdgeToken(this.#secret, serviceId, Date.now() + this.#opts.edgeTokenTtlS * 1000, a.salt)}` : null;
  }

  /** A ready service's public URL (stable but for `signed`); null when not ready or its deployment gives none. */
  publicUrlOf(row: ServiceRow): string | null {
    if (row.status !== "ready" || !row.machine_id) return null;
    const q = this.#credential(row.deployment_id, row.id);
    return q === null ? null : `${this.#baseOf(row.id)}/${q}`;
  }

  /** The deployment's own URL (any ready replica; it outlives rollouts): null for `signed` and without a public URL. */
  deploymentUrlOf(deploymentId: string): string | null {
    const q = this.#credential(deploymentId, undefined);
    return q === null ? null : `${this.#baseOf(deploymentId)}/${q}`;
  }

  /** `<scheme>://<label>.<edge domain>` (an origin of its own) or, without an edge domain, `<public URL>/edge/<id>`. */
  #baseOf(id: string): string {
    const domain = this.#opts.edgeDomain;
    return domain ? edgeOriginOf(id, domain, this.#opts.publicUrl) : `${this.#opts.publicUrl}/edge/${id}`;
  }

  /** The edge domain, when deployments have origins of their own. */
  get edgeDomain(): EdgeDomain | undefined {
    return this.#opts.edgeDomain;
  }

  /**
   * Decides an /edge request for `id` (a service's or a deployment's): the credential its deployment's access asks
   * for, compared in constant time. 401 for anything else, with the same answer whether or not `id` exists; 503 when
   * a deployment has no routable replica here.
   */
  authorize(id: string, token: string | undefined): EdgeGrant {
    const secret = this.#secret;
    if (!secret) throw new KilnError("unavailable", "The edge is not ready yet");
    const denied = (reason: string, why = "The edge_token is not valid for this URL") =>
      new KilnError("unauthorized", why, { detail: { code: "unauthorized", phase: "edge", details: { reason } } });
    const isDeployment = id.startsWith("dep_");
    const deploymentId = isDeployment ? id : this.routes.get(id)?.deploymentId;
    const a = deploymentId ? this.#access.get(deploymentId) : undefined;
    if (a && a.mode !== "signed") {
      if (a.mode === "token") {
        if (!token) throw denied("missing", "This public URL needs its edge_token");
        if (!sameToken(this.#tokenOf(deploymentId!, a, secret), token)) throw denied("bad_token");
      }
      const serviceId = isDeployment ? this.routes.pick(id) : id;
      if (!serviceId) throw new KilnError("unavailable", `Deployment ${id} has no running service here`, { detail: { retryable: true } });
      return { serviceId, deploymentId, mode: a.mode, expiresAtMs: undefined };
    }
    // Signed tokens name one service (deployment URLs have none); a service whose deployment gives no URL refuses them.
    if (isDeployment || (deploymentId && !a)) throw denied(token ? "bad_token" : "missing", token ? undefined : "This public URL needs its edge_token");
    if (!token) throw denied("missing", "This public URL needs its edge_token");
    // Signed tokens cover the deployment's salt: a rotation stops those already handed out (and their cookies).
    const salt = a?.salt ?? "";
    const known = this.#verified.known(id, salt, token);
    if (known !== undefined) return { serviceId: id, deploymentId, mode: "signed", expiresAtMs: known };
    const check = verifyEdgeToken(secret, id, token, Date.now(), salt);
    if (!check.ok) {
      const why = check.reason === "expired" ? "The edge_token has expired: read the service again for a fresh public_url" : "The edge_token is not valid for this service";
      throw denied(check.reason, why);
    }
    this.#verified.remember(id, salt, token, check.expiresAtMs);
    return { serviceId: id, deploymentId, mode: "signed", expiresAtMs: check.expiresAtMs };
  }

  /**
   * A tunnel to a routable service's port inside its machine: through the guest agent here, or through the cluster
   * tunnel when another host runs the replica. Either way a machine that is not running answers as it is (409), a
   * port that does not answer 503.
   */
  async openServicePort(serviceId: string, use: TunnelUse = "http"): Promise<Socket> {
    const route = this.routes.get(serviceId);
    if (!route) throw new KilnError("unavailable", `Service ${serviceId} is not running`);
    const silent = (err: unknown) => new KilnError("unavailable", `Service ${serviceId} does not answer on port ${route.port}`, { cause: err, detail: { retryable: true } });
    let remote: Socket | undefined;
    try {
      remote = await this.#remotePort?.(route.machineId, route.port, use);
    } catch (err) {
      throw err instanceof KilnError && err.code !== "unavailable" ? err : silent(err);
    }
    if (remote) return remote;
    const { agent } = await this.#machines.agentOf(route.machineId);
    try {
      return await agent.connectPort(route.port);
    } catch (err) {
      throw silent(err);
    }
  }

  /** Where replicas other hosts run are reached (the cluster tunnel); unset on a server alone on its store. */
  setRemotePort(open: RemotePort): void {
    this.#remotePort = open;
  }

  setProxy(p: TunnelOwner): void {
    this.#proxy = p;
  }

  /** Drops a stopping service's kept-alive tunnels. */
  dropTunnels(serviceId: string): void {
    this.#proxy?.drop(serviceId);
  }
}
