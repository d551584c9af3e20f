// Template builds, composed from their parts: prepare.ts checks a request before any stream starts, the phases in
// phases/ run the pipeline (one loop), failure.ts decides how a build that did not finish ends, artifacts.ts keeps
// artifacts and tags, history.ts shows records, recovery.ts ends builds a restart interrupted, retention.ts collects.

import { join } from "node:path";
import type { PageKey } from "../store/pages.ts";
import type { Db } from "../store/schema.ts";
import { KilnError } from "../errors.ts";
import type { Logger } from "../log.ts";
import type { MachineDriver } from "../runtime/driver.ts";
import type { TemplateService } from "../templates/service.ts";
import type { BuildRequestT } from "./request.ts";
import { emptyCacheSummary } from "./enums.ts";
import type { BuildPhase, BuildStatus } from "./enums.ts";
import { createBuildLogs } from "./log.ts";
import type { LogEntry, LogInput, LogSink } from "./log.ts";
import { createBlobStore } from "./context.ts";
import type { BlobStore } from "./context.ts";
import { createNativeBackend } from "./backends/native.ts";
import { createLayerCache } from "./cache/layers.ts";
import { decideEnding, errorDetail } from "./failure.ts";
import { createBuildRetention } from "./retention.ts";
import type { HeldLayers } from "./retention.ts";
import type { ClusterAvailability } from "./history.ts";
import { createArtifactStore } from "./artifacts.ts";
import { createBuildHistory } from "./history.ts";
import type { BuildListQuery, BuildView } from "./history.ts";
import { createPreparer } from "./prepare.ts";
import type { PreparedBuild } from "./prepare.ts";
import { recoverInterrupted } from "./recovery.ts";
import { runPhases } from "./phases/phase.ts";
import type { BuildRun, PhaseEnv } from "./phases/phase.ts";
import { BUILD_PIPELINE } from "./phases/index.ts";
import type { BuildExtensions } from "./extensions.ts";
import type { SnapshotBases } from "./sources/snapshot.ts";

export type { BuildExtensions } from "./extensions.ts";
export type { BuildListQuery, BuildView } from "./history.ts";

export interface BuildService {
  /** Checks and resolves a request, and claims its name; every mistake here is an HTTP error, not a build. */
  prepare(req: BuildRequestT, triggeredBy: string | null): Promise<PreparedBuild>;
  /** Records the build and starts it; the caller follows its log. A dropped follower never stops it. */
  start(p: PreparedBuild): Promise<{ buildId: string; templateId: string }>;
  list(id: string, q: BuildListQuery): Promise<{ builds: BuildView[]; last: PageKey | undefined; more: boolean }>;
  get(id: string, buildId: string): Promise<BuildView>;
  cancel(id: string, buildId: string): Promise<BuildView>;
  /** The build's log from after `lastEventId`, then live entries until its terminal one, at the sink's pace. */
  follow(buildId: string, lastEventId: number, sink: LogSink): ReturnType<ReturnType<typeof createBuildLogs>["follow"]>;
  /** Up to `limit` of the build's log entries after sequence number `afterSeq` (the store, or the unwritten tail). */
  readLog(buildId: string, afterSeq: number, limit: number): ReturnType<ReturnType<typeof createBuildLogs>["read"]>;
  aliases(ref: string): Promise<{ alias_ref: string; created_at: string }[]>;
  readonly blobs: BlobStore;
  /**
   * Builds a previous process of this host left running end `error`, with the phase they were in, and their log
   * says so; `lostHosts`: also those of hosts marked lost (with `reason`).
   */
  recoverInterrupted(lostHosts?: string[], reason?: string): Promise<number>;
  collect: ReturnType<typeof createBuildRetention>["collect"];
  startCollector(intervalMs?: number): void;
  /** Resolves once finished builds' machines are destroyed and the next build's machine (booted ahead) has started. */
  settle(): Promise<void>;
  close(): Promise<void>;
  isLive(buildId: string): boolean;
}

export function createBuildService(deps: {
  db: Db;
  driver: MachineDriver;
  templates: TemplateService;
  log: Logger;
  dataDir: string;
  retentionS: number;
  /** KILN_BUILD_LOG_MAX_BYTES. */
  logMaxBytes?: number;
  extensions?: BuildExtensions;
  /** Snapshots builds may start from (from_snapshot). */
  snapshots?: SnapshotBases;
  /** The host this server runs builds on (recorded on each build; recovery ends only this host's). */
  hostId?: string;
  /** On a store shared by hosts: layers' content digests, holdings and the cluster's availability (src/hosts/layers/). */
  layers?: HeldLayers & { digestOf(dir: string): Promise<string>; availableInCluster: ClusterAvailability };
}): BuildService {
  const { db, log } = deps;
  const logs = createBuildLogs({ db, log, maxBytes: deps.logMaxBytes });
  const blobs = createBlobStore(deps.dataDir);
  const layersDir = join(deps.dataDir, "layers");
  const layerCache = createLayerCache(db);
  const native = createNativeBackend({ driver: deps.driver, layerCache, layersDir, log, timeouts: deps.extensions?.nativeTimeouts });
  const artifacts = createArtifactStore({ db, retentionS: deps.retentionS, contentDigest: deps.layers?.digestOf });
  const history = createBuildHistory(db, deps.layers?.availableInCluster);
  const prepare = createPreparer({ db, templates: deps.templates, blobs, layersDir, extensions: deps.extensions, snapshots: deps.snapshots });
  const env: PhaseEnv = { db, driver: deps.driver, dataDir: deps.dataDir, layersDir, native, extensions: deps.extensions, artifacts, logs, layerCache, snapshots: deps.snapshots };
  const running = new Map<string, { abort: AbortController; done: Promise<void> }>();
  const retention = createBuildRetention({ db, layersDir, retentionS: deps.retentionS, buildsRunning: () => running.size > 0, ociCache: deps.extensions?.ociCache, held: deps.layers, blobs });
  let collector: NodeJS.Timeout | undefined;
  /** Set by close(): builds stopped by a shutdown end `error` (the server stopped), not `cancelled`. */
  let shuttingDown = false;

  async function start(p: PreparedBuild): Promise<{ buildId: string; templateId: string }> {
    const now = new Date().toISOString();
    await db
      .insertInto("builds")
      .values({
        id: p.buildId,
        template_id: p.template.id,
        name: p.name,
        tags_json: JSON.stringify(p.tags),
        status: "building",
        build_backend: p.backend,
        source_type: p.sourceType,
        source_digest: null,
        context_digest: p.contextDigest,
        dockerfile_digest: p.dockerfileDigest,
        triggered_by: p.triggeredBy,
        queued_at: now,
        started_at: now,
        finished_at: null,
        duration_ms: null,
        failure_phase: null,
        failure_reason: null,
        cache_summary_json: JSON.stringify(emptyCacheSummary()),
        artifact_ids_json: "[]",
        host_id: deps.hostId ?? null,
        retention_expires_at: null,
        created_at: now,
        updated_at: now,
      })
      .execute();
    logs.open(p.buildId, Object.values(p.request.build_envs ?? {}).concat((p.request.secrets ?? []).map((s) => s.value)));
    const abort = new AbortController();
    const done = pipeline(p, abort.signal)
      .catch((err: unknown) => log.error({ err, build_id: p.buildId }, "recording the end of a build failed"))
      .finally(() => running.delete(p.buildId));
    running.set(p.buildId, { abort, done });
    return { buildId: p.buildId, templateId: p.template.id };
  }

  /** Runs the phases, then records how the build ended and writes its terminal log entry. */
  async function pipeline(p: PreparedBuild, signal: AbortSignal): Promise<void> {
    const started = Date.now();
    const summary = emptyCacheSummary();
    let phase: BuildPhase = "preparing";
    // A Dockerfile the builder runs has its instructions as steps (its `STEP n/m` lines), not planned ones.
    const total = p.dockerfileExecutor?.kind === "builder" ? p.dockerfileExecutor.instructions : p.steps.length;
    const emit = (e: LogInput) => {
      if (e.phase) phase = e.phase;
      const entry: LogEntry = { level: "info", ...e, timestamp: new Date().toISOString(), build_id: p.buildId, template_id: p.template.id } as LogEntry;
      logs.append(p.buildId, entry);
    };
    const run: BuildRun = {
      p,
      signal,
      emit,
      count: (c) => {
        summary[c] = (summary[c] ?? 0) + 1;
      },
      srcDigest: null,
      reused: null,
    };
    emit({ kind: "start", phase: "preparing", message: `building ${p.name} (${p.sourceType}, ${p.backend}) with ${total} step${total === 1 ? "" : "s"}, tags ${p.tags.join(", ")}`, total_steps: total });
    let artifactIds: string[] = [];
    try {
      await runPhases(BUILD_PIPELINE, run, env);
      const artifactId = run.artifactId!;
      artifactIds = [artifactId];
      await finish(p, { status: "ready", artifactIds, summary, started, srcDigest: run.srcDigest });
      emit({ kind: "end", phase: "finalize", message: `${p.name} is ready: ${artifactId} tagged ${p.tags.join(", ")} in ${Date.now() - started} ms`, metadata: { artifact_id: artifactId, cache_summary: summary } });
    } catch (err) {
      const end = decideEnding(err, { phase, aborted: signal.aborted, shuttingDown });
      if (end.status === "error" && end.unexpected) log.error({ err, build_id: p.buildId }, "build failed unexpectedly");
      await finish(p, { status: end.status, artifactIds, summary, started, srcDigest: run.srcDigest, failurePhase: end.phase, failureReason: end.reason });
      if (end.status === "cancelled") {
        emit({ kind: "cancelled", level: "warn", phase: "cleanup", message: "the build was cancelled; everything it was running was stopped" });
      } else {
        emit({ kind: "error", level: "error", phase: end.phase, step_index: end.stepIndex, total_steps: end.stepIndex ? total : undefined, message: end.reason, error_detail: errorDetail(p.buildId, end) });
      }
    } finally {
      await logs.close(p.buildId);
    }
  }

  async function finish(p: PreparedBuild, r: { status: BuildStatus; artifactIds: string[]; summary: Record<string, number>; started: number; srcDigest: string | null; failurePhase?: BuildPhase | null; failureReason?: string | null }) {
    const now = new Date().toISOString();
    await db
      .updateTable("builds")
      .set({
        status: r.status,
        finished_at: now,
        updated_at: now,
        duration_ms: Date.now() - r.started,
        cache_summary_json: JSON.stringify(r.summary),
        artifact_ids_json: JSON.stringify(r.artifactIds),
        failure_phase: r.failurePhase ?? null,
        failure_reason: r.failureReason ?? null,
        source_digest: r.srcDigest,
      })
      .where("id", "=", p.buildId)
      .execute();
  }

  async function cancel(id: string, buildId: string): Promise<BuildView> {
    const row = await history.loadBuild(id, buildId);
    const run = running.get(buildId);
    if (!run) {
      if (row.status === "building" || row.status === "waiting") throw new KilnError("conflict", `Build ${buildId} is not running in this server`);
      throw new KilnError("conflict", `Build ${buildId} already ended ${row.status}`, { buildId });
    }
    run.abort.abort();
    await run.done;
    return history.view(await history.loadBuild(id, buildId));
  }

  function startCollector(intervalMs = 60_000) {
    collector = setInterval(() => void retention.collect().catch((err: unknown) => log.error({ err }, "build retention collection failed")), intervalMs);
    collector.unref();
  }

  async function close() {
    if (collector) clearInterval(collector);
    shuttingDown = true;
    // Running builds end with the process; the next start marks them error (their machines are removed by adoption).
    for (const r of running.values()) r.abort.abort();
    await Promise.all([...running.values()].map((r) => r.done.catch(() => undefined)));
    await native.close?.();
  }

  return {
    prepare,
    start,
    list: history.list,
    get: async (id, buildId) => history.view(await history.loadBuild(id, buildId)),
    cancel,
    follow: (buildId, lastEventId, sink) => logs.follow(buildId, lastEventId, sink),
    readLog: (buildId, afterSeq, limit) => logs.read(buildId, afterSeq, limit),
    aliases: history.aliases,
    blobs,
    recoverInterrupted: (lostHosts = [], reason) =>
      lostHosts.length ? recoverInterrupted(db, () => false, lostHosts, reason) : recoverInterrupted(db, (id) => running.has(id), deps.hostId ? [deps.hostId] : [], reason),
    collect: retention.collect,
    startCollector,
    settle: async () => {
      await native.settle?.();
    },
    close,
    isLive: logs.isLive,
  };
}
