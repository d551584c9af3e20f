// Agent deployments, composed from their parts: the records and views (records.ts, views.ts), replicas and their
// supervision (supervision.ts), rolling updates (rollout.ts) and the edge (edge.ts). This file holds the operations
// the API offers (create, update, list, delete, restart, logs) and re-attachment after a restart.

import type { Socket } from "node:net";
import { randomBytes } from "node:crypto";
import { createKeyedLock } from "../keyed-lock.ts";
import type { Db, DeploymentRow, ServiceRow } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import type { Logger } from "../log.ts";
import type { MachineService } from "../machines/service.ts";
import type { TemplateService } from "../templates/service.ts";
import { SERVICE_EVENT_OPERATIONS } from "./lifecycle.ts";
import type { ReadinessDetail, ServiceStatus } from "./lifecycle.ts";
import { loadEnvSealer } from "./sealed-envs.ts";
import type { EnvSealer } from "./sealed-envs.ts";
import { createDeploymentRecords } from "./records.ts";
import { DeploymentEdge } from "./edge.ts";
import type { EdgeGrant, TunnelOwner } from "./edge.ts";
import type { EdgeDomain } from "./edge-origin.ts";
import { ServiceSupervision } from "./supervision.ts";
import { Rollouts } from "./rollout.ts";
import { READINESS_DEFAULTS, deploymentView, readinessOfVersion, serviceView } from "./views.ts";
import type { DeploymentView, Readiness, ServiceView } from "./views.ts";
import type { CreateDeploymentInput, ReadinessInput, RestartInput, UpdateDeploymentInput } from "./schemas.ts";
import { newestFirstPage } from "../store/pages.ts";
import { ReplicaHosts } from "./spread.ts";
import type { ReplicaCluster } from "./spread.ts";
import type { RemotePort, TunnelUse } from "../hosts/tunnel.ts";

/** How often the store is asked for deployments whose edge access changed on another server. */
const ACCESS_POLL_MS = 1000;
/**
 * How long a lost host found with no replica left to end (and no rollout to take over) is skipped by the sweep that
 * runs at each heartbeat; then it is looked at once more (a replica written there late is still ended). Bounded.
 */
const LOST_RECHECK_MS = 5 * 60_000;
const SETTLED_LOST_MAX = 10_000;

export interface DeploymentOptions {
  dataDir: string;
  /** Base of public URLs (KILN_PUBLIC_URL); may be set later when the server learns its port. */
  publicUrl: string;
  maxCrashes: number;
  backoffMs: number;
  edgeTokenTtlS: number;
  /** KILN_EDGE_DOMAIN: each deployment's pages on an origin of its own (`<label>.<domain>`); unset: /edge/<id>/ on the API's origin, sandboxed. */
  edgeDomain?: EdgeDomain;
  /** KILN_DEPLOYMENT_ENVS_KEY_FILE: the key that seals deployment envs, shared by the servers of a store; unset: the data dir's own. */
  envsKeyFile?: string;
}

export interface DeploymentService {
  create(input: CreateDeploymentInput): Promise<DeploymentView>;
  update(id: string, input: UpdateDeploymentInput): Promise<DeploymentView>;
  get(id: string): Promise<DeploymentView>;
  list(o: { limit: number; after?: [string, string] }): Promise<{ deployments: DeploymentView[]; last: [string, string] | undefined; more: boolean }>;
  remove(id: string): Promise<DeploymentView>;
  listServices(deploymentId: string, o?: { status?: ServiceStatus }): Promise<ServiceView[]>;
  getService(deploymentId: string, serviceId: string): Promise<ServiceView>;
  serviceLogs(deploymentId: string, serviceId: string, tailBytes: number): Promise<{ service_id: string; process_id: number | null; output: string; total_bytes: number; truncated: boolean }>;
  restart(deploymentId: string, serviceId: string, input: RestartInput, idempotencyKey?: string): Promise<ServiceView>;
  /** Replaces a deployment's long-lived edge token: the old one stops at once (here, and within a second elsewhere). */
  rotateEdgeToken(id: string): Promise<DeploymentView>;
  /** Decides an /edge request for a service or deployment id; 401 for a credential its access does not take. */
  authorizeEdge(id: string, token: string | undefined): EdgeGrant;
  /** Calls `fn` with a deployment whose edge access changed (its open WebSockets are cut). */
  onAccessChanged(fn: (deploymentId: string) => void): void;
  /** A tunnel to a routable service's port inside its machine. */
  openServicePort(serviceId: string, use?: TunnelUse): Promise<Socket>;
  /** How the edge reaches replicas other hosts run (the cluster tunnel; src/hosts/tunnel.ts). */
  setRemotePort(open: RemotePort): void;
  isRoutable(serviceId: string): boolean;
  /** Whether the edge reads the store each second for other hosts' writes and replicas (not while alone on it). */
  edgePolls(): boolean;
  /** The edge proxy registers itself so a stopping service's kept-alive tunnels are dropped. */
  setProxy(p: TunnelOwner): void;
  start(): Promise<void>;
  setPublicUrl(url: string): void;
  /** On a store shared by hosts: replicas spread across them (docs/deployments.md, "Many hosts"). */
  connectCluster(cluster: ReplicaCluster): void;
  /** A replica another host asked this one to make (it runs the machine and supervises the service). */
  replicaHere(deploymentId: string, versionId: string, envs: Record<string, string>, detail?: ReadinessDetail): Promise<ServiceRow>;
  /** Stops a replica whose machine this host runs (asked by another host). */
  stopHere(serviceId: string): Promise<ServiceRow>;
  /** A host was lost: its replicas end (once per cluster) and their deployments make new ones elsewhere. */
  rescheduleLost(host: { id: string; name: string; lost_at?: string | null }, reason: string): Promise<void>;
  close(): Promise<void>;
}

export function createDeploymentService(deps: {
  db: Db;
  machines: MachineService;
  templates: TemplateService;
  log: Logger;
  options: DeploymentOptions;
  hostId: string;
  /** The store takes row locks (`FOR UPDATE SKIP LOCKED`): PostgreSQL. */
  rowLocks?: boolean;
}): DeploymentService {
  const { db, machines, log } = deps;
  const opts = { ...deps.options };
  const locks = createKeyedLock();
  const withLock = locks.run;
  let sealer: EnvSealer | undefined;
  const edge = new DeploymentEdge(machines, opts);
  const records = createDeploymentRecords(db, (row) => edge.routes.track(row), { rowLocks: deps.rowLocks ?? false });
  const spread = new ReplicaHosts(db, deps.hostId);
  const supervision = new ServiceSupervision({ db, machines, log, records, edge, locks, opts, openEnvs: (sealed) => sealer!.open(sealed), hostId: deps.hostId, spread });
  const rollouts = new Rollouts({ db, log, records, supervision, hostId: deps.hostId });
  const { loadDeployment, loadVersion, loadService } = records;
  const view = (row: DeploymentRow, withVersions: boolean) => {
    edge.setAccess(row);
    return deploymentView(db, row, withVersions, edge.deploymentUrlOf(row.id));
  };
  const serviceOut = (row: Parameters<typeof serviceView>[0], publicAllowed: boolean) => serviceView(row, publicAllowed ? edge.publicUrlOf(row) : null, supervision.probes.of(row));
  const newSalt = () => randomBytes(16).toString("hex");

  /** Deployment envs are sealed before they reach the store; only their names are kept in the clear. */
  function sealEnvs(envs: Record<string, string>) {
    if (!sealer) throw new KilnError("unavailable", "Deployments are not ready yet");
    return { envs_sealed: sealer.seal(envs), env_names_json: JSON.stringify(Object.keys(envs).sort()) };
  }

  /**
   * The previous version's envs for a new one: sealed again under this server's key when it can open them (so a
   * PATCH moves a deployment onto a shared key, docs/deployments.md), else kept as they are.
   */
  function resealed(sealed: string): string {
    try {
      return sealer ? sealer.seal(sealer.open(sealed)) : sealed;
    } catch {
      return sealed;
    }
  }

  /** The readiness settings of a version: a given `readiness` object replaces the whole of the previous one. */
  function readinessOf(input: ReadinessInput | undefined, base?: Readiness): Readiness {
    if (!input && base) return base;
    const r: Readiness = { interval_s: input?.interval_s ?? READINESS_DEFAULTS.intervalS, timeout_s: input?.timeout_s ?? READINESS_DEFAULTS.timeoutS };
    if (input?.path !== undefined) r.path = input.path;
    return r;
  }

  async function create(input: CreateDeploymentInput) {
    await deps.templates.resolve(input.template); // an unknown template is a 404 before anything is made
    const now = new Date().toISOString();
    const depId = newId("dep");
    const version = {
      id: newId("ver"),
      deployment_id: depId,
      number: 1,
      template: input.template,
      command: input.command,
      port: input.port,
      ...sealEnvs(input.envs ?? {}),
      readiness_json: JSON.stringify(readinessOf(input.readiness)),
      created_at: now,
    };
    const dep: DeploymentRow = {
      id: depId,
      name: input.name,
      current_version_id: version.id,
      replicas: input.replicas ?? 1,
      public_url: input.public_url === false ? 0 : 1,
      access: input.access ?? "token",
      edge_salt: newSalt(),
      status: "active",
      rollout_status: "rolling",
      rollout_error: null,
      rollout_host_id: deps.hostId,
      created_at: now,
      updated_at: now,
      deleted_at: null,
    };
    await db.transaction().execute(async (tx) => {
      await tx.insertInto("deployments").values(dep).execute();
      await tx.insertInto("deployment_versions").values(version).execute();
    });
    edge.setAccess(dep);
    // The first replicas are made before the answer, so the client sees them (starting) and a failing template or
    // machine admission is an error of this request; later ones (updates) roll in the background.
    try {
      for (let i = 0; i < dep.replicas; i++) await supervision.createReplica(dep, version);
      await records.setRollout(depId, "idle", null);
    } catch (err) {
      // The client gets the error and no id: nothing of this deployment may stay behind.
      await remove(depId).catch((e: unknown) => log.error({ err: e, deployment_id: depId }, "removing a deployment whose replicas failed to start failed"));
      throw err;
    }
    return view(await loadDeployment(depId), true);
  }

  async function update(id: string, input: UpdateDeploymentInput) {
    // Access is the edge's business, not the replicas': changing only it makes no version and rolls nothing.
    if (Object.keys(input).every((k) => k === "access")) {
      const changed = await withLock(`dep:${id}`, async () => {
        const dep = await loadDeployment(id);
        if (dep.status !== "active") throw new KilnError("conflict", `Deployment ${id} is ${dep.status}`);
        await db.updateTable("deployments").set({ access: input.access!, updated_at: new Date().toISOString() }).where("id", "=", id).execute();
        return loadDeployment(id);
      });
      return view(changed, true);
    }
    const updated = await withLock(`dep:${id}`, async () => {
      const dep = await loadDeployment(id);
      if (dep.status !== "active") throw new KilnError("conflict", `Deployment ${id} is ${dep.status}`);
      const cur = await loadVersion(dep.current_version_id);
      if (input.template !== undefined) await deps.templates.resolve(input.template);
      const now = new Date().toISOString();
      const last = await db.selectFrom("deployment_versions").select((eb) => eb.fn.max("number").as("n")).where("deployment_id", "=", id).executeTakeFirstOrThrow();
      const version = {
        id: newId("ver"),
        deployment_id: id,
        number: Number(last.n) + 1,
        template: input.template ?? cur.template,
        command: input.command ?? cur.command,
        port: input.port ?? cur.port,
        ...(input.envs !== undefined ? sealEnvs(input.envs) : { envs_sealed: resealed(cur.envs_sealed), env_names_json: cur.env_names_json }),
        readiness_json: JSON.stringify(readinessOf(input.readiness, readinessOfVersion(cur))),
        created_at: now,
      };
      await db.transaction().execute(async (tx) => {
        await tx.insertInto("deployment_versions").values(version).execute();
        await tx
          .updateTable("deployments")
          .set({
            name: input.name ?? dep.name,
            current_version_id: version.id,
            replicas: input.replicas ?? dep.replicas,
            public_url: input.public_url === undefined ? dep.public_url : input.public_url ? 1 : 0,
            access: input.access ?? dep.access,
            rollout_status: "rolling",
            rollout_error: null,
            rollout_host_id: deps.hostId,
            updated_at: now,
          })
          .where("id", "=", id)
          .execute();
      });
      return loadDeployment(id);
    });
    void rollouts.run(id);
    return view(updated, true);
  }

  async function rotateEdgeToken(id: string) {
    const row = await withLock(`dep:${id}`, async () => {
      const dep = await loadDeployment(id);
      if (dep.status !== "active") throw new KilnError("conflict", `Deployment ${id} is ${dep.status}`);
      await db.updateTable("deployments").set({ edge_salt: newSalt(), updated_at: new Date().toISOString() }).where("id", "=", id).execute();
      return loadDeployment(id);
    });
    return view(row, true);
  }

  async function get(id: string) {
    return view(await loadDeployment(id), true);
  }

  async function list(o: { limit: number; after?: [string, string] }) {
    const page = await newestFirstPage(db.selectFrom("deployments").selectAll().where("status", "!=", "deleted"), o);
    return { deployments: await Promise.all(page.rows.map((r) => view(r, false))), last: page.last, more: page.more };
  }

  async function remove(id: string) {
    const dep = await withLock(`dep:${id}`, async () => {
      const row = await loadDeployment(id);
      if (row.status === "deleted") return row;
      await db.updateTable("deployments").set({ status: "deleting", updated_at: new Date().toISOString() }).where("id", "=", id).execute();
      edge.setAccess({ ...row, status: "deleting", updated_at: new Date().toISOString() }); // its URLs stop before its services do
      return row;
    });
    if (dep.status !== "deleted") {
      await rollouts.settled(id);
      const rows = await db.selectFrom("services").selectAll().where("deployment_id", "=", id).where("status", "not in", ["stopped"]).execute();
      for (const s of rows) await supervision.stopReplica(s.id);
      const now = new Date().toISOString();
      await db.updateTable("deployments").set({ status: "deleted", rollout_status: "idle", deleted_at: now, updated_at: now }).where("id", "=", id).execute();
    }
    return view(await loadDeployment(id), true);
  }

  async function listServices(deploymentId: string, o: { status?: ServiceStatus } = {}) {
    const dep = await loadDeployment(deploymentId);
    let q = db.selectFrom("services").selectAll().where("deployment_id", "=", deploymentId).orderBy("created_at", "desc").orderBy("id", "desc");
    if (o.status) q = q.where("status", "=", o.status);
    const rows = await q.execute();
    return rows.map((r) => serviceOut(r, dep.public_url === 1));
  }

  async function getService(deploymentId: string, serviceId: string) {
    const dep = await loadDeployment(deploymentId);
    return serviceOut(await loadService(serviceId, deploymentId), dep.public_url === 1);
  }

  async function serviceLogs(deploymentId: string, serviceId: string, tailBytes: number) {
    const row = await loadService(serviceId, deploymentId);
    const { agent } = await machines.agentOf(row.machine_id).catch(() => {
      throw new KilnError("conflict", `The machine of service ${serviceId} is gone, and its output with it`);
    });
    const logs = await agent.serviceLogs(serviceId, tailBytes);
    return { service_id: serviceId, process_id: row.process_id, output: Buffer.from(logs.data_base64, "base64").toString("utf8"), total_bytes: logs.total_bytes, truncated: logs.truncated };
  }

  /**
   * Restarts a service's process. `envs` go to the agent in this call only (it keeps them in memory for that process
   * and its crash-restarts); nothing here writes them anywhere. A repeated Idempotency-Key answers the first result.
   */
  async function restart(deploymentId: string, serviceId: string, input: RestartInput, idempotencyKey?: string): Promise<ServiceView> {
    const dep = await loadDeployment(deploymentId);
    await loadService(serviceId, deploymentId);
    return withLock(serviceId, async () => {
      if (idempotencyKey !== undefined) {
        const first = await db.selectFrom("service_restarts").select("result_json").where("service_id", "=", serviceId).where("idempotency_key", "=", idempotencyKey).executeTakeFirst();
        if (first) return { ...(JSON.parse(first.result_json) as ServiceView), public_url: null };
      }
      const row = await loadService(serviceId, deploymentId);
      if (row.status === "stopping" || row.status === "stopped") throw new KilnError("conflict", `Service ${serviceId} is ${row.status}`);
      const { agent } = await machines.agentOf(row.machine_id).catch(() => {
        throw new KilnError("conflict", `The machine of service ${serviceId} is not running`);
      });
      const state = await agent.restartService(serviceId, input.envs);
      const now = new Date().toISOString();
      const stored = JSON.parse(row.readiness_json) as ReadinessDetail;
      // The probe's record starts over with the new process; the process counters and restarts carry on.
      const detail: ReadinessDetail = {
        phase: "starting",
        probe: stored.probe,
        ...(stored.path ? { path: stored.path } : {}),
        attempts: 0,
        consecutive_failures: 0,
        last_error: null,
        last_exit: state.last_exit,
        starts: state.starts,
        crashes: state.crashes,
        consecutive_crashes: state.consecutive_crashes,
        restarts: { count: (stored.restarts?.count ?? 0) + 1, last_reason: input.reason ?? null, last_at: now },
      };
      supervision.probes.forget(serviceId);
      const after = await records.transition(
        serviceId,
        { status: "starting", process_id: state.pid, started_at: state.started_at ?? now, stopped_at: null, failure_reason: null, idempotency_key: idempotencyKey ?? null, readiness_json: JSON.stringify(detail) },
        SERVICE_EVENT_OPERATIONS.restart,
        async (tx, r) => {
          if (idempotencyKey === undefined) return;
          await tx.insertInto("service_restarts").values({ service_id: serviceId, idempotency_key: idempotencyKey, result_json: JSON.stringify(serviceOut(r, false)), created_at: now }).execute();
        },
      );
      const version = await loadVersion(after.version_id);
      supervision.watch(after, readinessOfVersion(version));
      return serviceOut(after, dep.public_url === 1);
    });
  }

  /**
   * After a (re)start: the edge secret is loaded, services that were running are re-attached without restarting
   * their processes (the agents kept them), half-stopped ones are finished, and unfinished rollouts resume: those
   * this host's server ran (wherever their replicas run), and those recorded before rollouts named their runner.
   */
  async function start() {
    await edge.load(db, opts.dataDir);
    sealer = await loadEnvSealer(opts.dataDir, opts.envsKeyFile);
    await pollAccess();
    accessPoll = setInterval(() => {
      // Alone on its store, every write is this server's own and reaches the edge as it is made: nothing to poll for.
      if (!edgePolls()) return;
      void pollAccess().catch((err: unknown) => log.warn({ err }, "reading deployments' edge access failed"));
    }, ACCESS_POLL_MS);
    accessPoll.unref();
    if (!opts.edgeDomain) {
      const shared = await db.selectFrom("deployments").select((eb) => eb.fn.countAll<number>().as("n")).where("status", "=", "active").where("public_url", "=", 1).executeTakeFirst();
      if (Number(shared?.n ?? 0) > 0) log.warn({ deployments: Number(shared?.n) }, "deployments' pages share the API's origin (/edge/<id>/, sandboxed): set KILN_EDGE_DOMAIN to give each its own (docs/deployments.md)");
    }
    // On a store shared by several servers, each supervises the services whose machines it runs.
    const rows = await db
      .selectFrom("services")
      .innerJoin("machines", "machines.id", "services.machine_id")
      .selectAll("services")
      .where("machines.host_id", "=", deps.hostId)
      .where("services.status", "in", ["starting", "ready", "unhealthy", "stopping"])
      .execute();
    let attached = 0;
    for (const row of rows) {
      if (row.status === "stopping") {
        void supervision.stopReplica(row.id);
        continue;
      }
      edge.routes.track(row);
      const version = await loadVersion(row.version_id);
      supervision.watch(row, readinessOfVersion(version), 0);
      attached++;
    }
    const ours = new Set(rows.map((r) => r.deployment_id));
    const deleting = (await db.selectFrom("deployments").select("id").where("status", "=", "deleting").execute()).filter((d) => ours.has(d.id));
    for (const d of deleting) void remove(d.id).catch((err: unknown) => log.error({ err, deployment_id: d.id }, "finishing a delete failed"));
    await resumeRollouts();
    if (rows.length > 0) log.info({ services: attached }, "services re-attached after start");
  }

  /**
   * The edge's view of every deployment's access, read from the store: all at start, then each second the rows
   * written since (by this server or another on the store), so a rotation or delete made elsewhere stops the old
   * token here within about a second. Timestamps are ISO strings; ">=" re-reads the last instant's rows (harmless).
   * Only while other hosts share the store (or replicas of one that left are still routed): a server alone skips it.
   */
  let accessSince = "";
  let accessPoll: NodeJS.Timeout | undefined;
  async function pollAccess() {
    const rows = await db.selectFrom("deployments").select(["id", "status", "public_url", "access", "edge_salt", "updated_at"]).where("updated_at", ">=", accessSince).execute();
    for (const r of rows) {
      edge.setAccess(r);
      if (r.updated_at > accessSince) accessSince = r.updated_at;
    }
    await pollRemoteServices();
  }

  /**
   * The replicas other hosts of the store run, read with the access: the edge here routes to them through the
   * cluster tunnel. All routable ones at start, then each second the rows written since; one that stops being
   * routable drops its kept-alive tunnels. This server's own replicas are tracked from its own writes.
   */
  let servicesSince = "";
  /** Other hosts' replicas the edge here routes to (the poll goes on while there are any, to see them end). */
  const remoteRouted = new Set<string>();
  const edgePolls = () => spread.peered || remoteRouted.size > 0;
  async function pollRemoteServices() {
    let q = db.selectFrom("services").innerJoin("machines", "machines.id", "services.machine_id").selectAll("services").where("machines.host_id", "is not", null).where("machines.host_id", "!=", deps.hostId);
    q = servicesSince === "" ? q.where("services.status", "in", ["starting", "ready", "unhealthy"]) : q.where("services.updated_at", ">=", servicesSince);
    for (const row of await q.execute()) {
      const routed = edge.routes.has(row.id);
      edge.routes.track(row);
      if (routed && !edge.routes.has(row.id)) edge.dropTunnels(row.id);
      if (edge.routes.has(row.id)) remoteRouted.add(row.id);
      else remoteRouted.delete(row.id);
      if (row.updated_at > servicesSince) servicesSince = row.updated_at;
    }
  }

  function setPublicUrl(url: string) {
    opts.publicUrl = url.replace(/\/+$/, "");
  }

  async function replicaHere(deploymentId: string, versionId: string, envs: Record<string, string>, detail?: ReadinessDetail) {
    const dep = await loadDeployment(deploymentId);
    if (dep.status !== "active") throw new KilnError("conflict", `Deployment ${deploymentId} is ${dep.status}`);
    const version = await loadVersion(versionId);
    if (version.deployment_id !== deploymentId) throw new KilnError("not_found", `No version ${versionId} in deployment ${deploymentId}`);
    return supervision.createHere(dep, version, envs, detail);
  }

  /** Whether this server can open the envs of the deployment's current version (sealed with a data dir's key). */
  async function canOpenEnvs(deploymentId: string): Promise<boolean> {
    const dep = await db.selectFrom("deployments").select("current_version_id").where("id", "=", deploymentId).executeTakeFirst();
    const version = dep?.current_version_id ? await db.selectFrom("deployment_versions").select("envs_sealed").where("id", "=", dep.current_version_id).executeTakeFirst() : undefined;
    if (!version || !sealer) return false;
    try {
      sealer.open(version.envs_sealed);
      return true;
    } catch {
      return false;
    }
  }

  /**
   * Rolling deployments whose rollout this server runs, or whose runner is not recorded (claimed here by a
   * conditional update, when this server can open their envs), that no rollout here is running: resumed. A kill -9
   * mid-rollout leaves the deployment rolling; its server resumes it at start.
   */
  async function resumeRollouts() {
    const rolling = await db
      .selectFrom("deployments")
      .select(["id", "rollout_host_id"])
      .where("status", "=", "active")
      .where("rollout_status", "=", "rolling")
      .where((eb) => eb.or([eb("rollout_host_id", "=", deps.hostId), eb("rollout_host_id", "is", null)]))
      .execute();
    for (const d of rolling) {
      if (rollouts.running(d.id) || rollouts.closed) continue;
      if (d.rollout_host_id === null && !((await canOpenEnvs(d.id)) && (await records.claimRollout(d.id, null, deps.hostId)))) continue;
      log.info({ deployment_id: d.id }, "resuming an unfinished rollout");
      void rollouts.run(d.id);
    }
  }

  /**
   * Lost hosts this server found with nothing left to end or take over (host id and lost_at → when): skipped by the
   * sweeps of the next minutes rather than queried at every heartbeat. A host lost again has another lost_at.
   */
  const settledLost = new Map<string, number>();

  async function rescheduleLost(host: { id: string; name: string; lost_at?: string | null }, reason: string) {
    const settledKey = `${host.id}@${host.lost_at ?? ""}`;
    const settledAt = settledLost.get(settledKey);
    if (settledAt !== undefined && Date.now() - settledAt < LOST_RECHECK_MS) return;
    settledLost.delete(settledKey);
    // Rollouts the lost host's server ran (a PATCH there, or its own replacements): taken over by one server that can
    // open the deployment's envs, which resumes it.
    const orphaned = await db.selectFrom("deployments").select("id").where("status", "=", "active").where("rollout_status", "=", "rolling").where("rollout_host_id", "=", host.id).execute();
    for (const { id } of orphaned) {
      if (rollouts.closed || !(await canOpenEnvs(id)) || !(await records.claimRollout(id, host.id, deps.hostId))) continue;
      log.warn({ deployment_id: id, host_id: host.id }, "the rollout of a lost host's server taken over here");
      void rollouts.run(id);
    }
    const rows = await db
      .selectFrom("services")
      .innerJoin("machines", "machines.id", "services.machine_id")
      .select("services.deployment_id as deployment_id")
      .distinct()
      .where("machines.host_id", "=", host.id)
      .where("services.status", "in", ["starting", "ready", "unhealthy", "stopping"])
      .execute();
    for (const { deployment_id: id } of rows) {
      // Its envs are sealed with the key of the server that took its create or last PATCH: only a server holding that
      // key can start the replacements, so only such a server ends the replicas and reschedules them (every server's
      // sweep comes here; the others leave it to one that can).
      if (!(await canOpenEnvs(id))) continue;
      const ended = await records.claimLost(id, host.id, reason, deps.hostId);
      const failed = ended.filter((r) => r.status === "failed");
      if (ended.length === 0) continue;
      log.warn({ deployment_id: id, host_id: host.id, failed: failed.map((r) => r.id), stopped: ended.length - failed.length }, "replicas of a lost host ended; the deployment makes new ones on the other hosts");
      if (failed.length > 0 && !rollouts.closed) void rollouts.run(id, { rescheduled: { replaces: failed.map((r) => r.id), from_host: host.id, reason } });
    }
    if (rows.length === 0 && orphaned.length === 0) {
      if (settledLost.size >= SETTLED_LOST_MAX) settledLost.delete(settledLost.keys().next().value!);
      settledLost.set(settledKey, Date.now());
    }
  }

  async function close() {
    clearInterval(accessPoll);
    const rolloutsDone = rollouts.close();
    supervision.close();
    await rolloutsDone;
    await locks.drain();
    await spread.close();
  }

  return {
    create,
    update,
    get,
    list,
    remove,
    listServices,
    getService,
    serviceLogs,
    restart,
    rotateEdgeToken,
    authorizeEdge: (id, token) => edge.authorize(id, token),
    onAccessChanged: (fn) => edge.onAccessChanged(fn),
    openServicePort: (serviceId, use) => edge.openServicePort(serviceId, use),
    setRemotePort: (open) => edge.setRemotePort(open),
    isRoutable: (serviceId) => edge.routes.has(serviceId),
    edgePolls,
    setProxy: (p) => edge.setProxy(p),
    start,
    setPublicUrl,
    connectCluster: (cluster) => spread.connect(cluster),
    replicaHere,
    stopHere: (serviceId) => supervision.stopReplica(serviceId),
    rescheduleLost,
    close,
  };
}
