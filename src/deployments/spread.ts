// Replicas across hosts: on a store shared by several servers, a deployment's replicas go to the active hosts that
// run the fewest replicas of it (then placement's own order: free capacity, load), so its replicas land on
// different hosts where capacity allows. A replica on another host is made and stopped by that host (it runs the
// machine, starts the process and supervises it), asked through a cluster-signed call (docs/deployments.md).

import { Agent, request } from "undici";
import type { Dispatcher } from "undici";
import { sql } from "kysely";
import type { Db, HostRow, ServiceRow } from "../store/schema.ts";
import { ERROR_CATALOGUE, KilnError } from "../errors.ts";
import type { ErrorCode } from "../errors.ts";
import type { ClusterAuth } from "../hosts/cluster-auth.ts";

/** How long a peer may take to make a replica (a machine boot and a process start) or to stop one. */
const PEER_CALL_MS = 5 * 60_000;
const LIVE_SERVICES = ["starting", "ready", "unhealthy"] as const;

export interface ReplicaCluster {
  auth: ClusterAuth;
  hosts: () => Promise<Map<string, HostRow>>;
  /** Placement's candidates (active, fresh, accepting), best first; this host among them when it is active. */
  candidates: () => Promise<HostRow[]>;
  /** Whether another host (not lost) shares the store, as last seen (no query). */
  hasPeers: () => boolean;
}

export class ReplicaHosts {
  readonly #db: Db;
  readonly #hostId: string;
  #cluster: ReplicaCluster | undefined;
  readonly #agent = new Agent({ keepAliveTimeout: 10_000, headersTimeout: PEER_CALL_MS, bodyTimeout: PEER_CALL_MS, connect: { timeout: 5_000 } });

  constructor(db: Db, hostId: string) {
    this.#db = db;
    this.#hostId = hostId;
  }

  connect(cluster: ReplicaCluster): void {
    this.#cluster = cluster;
  }

  /** Whether other hosts share the store (false without a cluster): their replicas and writes are worth polling for. */
  get peered(): boolean {
    return this.#cluster?.hasPeers() ?? false;
  }

  /**
   * The hosts a new replica of `deploymentId` may go to, best first: fewest live replicas of this deployment, then
   * placement's order. Without a cluster: this host only.
   */
  async order(deploymentId: string): Promise<{ id: string; url: string }[]> {
    const here = [{ id: this.#hostId, url: "" }];
    if (!this.#cluster) return here;
    const hosts = await this.#cluster.candidates();
    if (hosts.length === 0) return here; // this host's admission says why
    const rows = await this.#db
      .selectFrom("services")
      .innerJoin("machines", "machines.id", "services.machine_id")
      .select(["machines.host_id as host_id", sql<number>`count(*)`.as("n")])
      .where("services.deployment_id", "=", deploymentId)
      .where("services.status", "in", LIVE_SERVICES)
      .groupBy("machines.host_id")
      .execute();
    const replicas = new Map(rows.map((r) => [r.host_id, Number(r.n)]));
    const rank = new Map(hosts.map((h, i) => [h.id, i]));
    return [...hosts]
      .sort((a, b) => (replicas.get(a.id) ?? 0) - (replicas.get(b.id) ?? 0) || rank.get(a.id)! - rank.get(b.id)!)
      .map((h) => ({ id: h.id, url: h.advertise_url }));
  }

  /** The host a service's machine runs on when it is another host that is not lost (else undefined: handled here). */
  async remoteOwner(machineId: string): Promise<{ id: string; url: string } | undefined> {
    if (!this.#cluster) return undefined;
    const row = await this.#db.selectFrom("machines").select("host_id").where("id", "=", machineId).executeTakeFirst();
    if (!row?.host_id || row.host_id === this.#hostId) return undefined;
    const host = (await this.#cluster.hosts()).get(row.host_id);
    return host && host.status !== "lost" ? { id: host.id, url: host.advertise_url } : undefined;
  }

  /** Asks `host` to make a replica of the deployment's version (envs opened here: the sealing key is per host). */
  async createOn(host: { id: string; url: string }, body: { deployment_id: string; version_id: string; envs: Record<string, string>; detail?: Record<string, unknown> }): Promise<ServiceRow> {
    const out = await this.#call(host, "POST", `/v1/cluster/deployments/${body.deployment_id}/replicas`, body);
    return out as ServiceRow;
  }

  async stopOn(host: { id: string; url: string }, serviceId: string): Promise<ServiceRow> {
    return (await this.#call(host, "POST", `/v1/cluster/services/${serviceId}/stop`, {})) as ServiceRow;
  }

  async #call(host: { id: string; url: string }, method: "POST", path: string, body: unknown): Promise<unknown> {
    const auth = this.#cluster!.auth;
    const text = JSON.stringify(body);
    let res: Dispatcher.ResponseData;
    try {
      res = await request(host.url + path, {
        method,
        headers: { "content-type": "application/json", ...auth.sign(method, path, host.id, undefined) },
        body: text,
        dispatcher: this.#agent,
      });
    } catch (err) {
      throw new KilnError("unavailable", `Host ${host.id} could not be reached: ${(err as Error).message.slice(0, 200)}`, { detail: { retryable: true } });
    }
    const answer = (await res.body.json().catch(() => undefined)) as { code?: string; error?: string } | undefined;
    if (res.statusCode >= 200 && res.statusCode < 300) return answer;
    const code = (answer?.code && answer.code in ERROR_CATALOGUE ? answer.code : res.statusCode === 503 ? "unavailable" : "internal") as ErrorCode;
    throw new KilnError(code, `Host ${host.id}: ${answer?.error ?? `answered ${res.statusCode}`}`);
  }

  close(): Promise<void> {
    return this.#agent.close();
  }
}
