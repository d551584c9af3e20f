// Template builds: validation before any stream starts, the pipeline (sources → final-artifact cache → backend →
// artifact and tags) with its durable log, build records with SPEC.md's fields, history, cancel, aliases, restart
// recovery, and the timer that runs the retention collector (build-retention.ts).

import { createHash, timingSafeEqual } from "node:crypto";
import { existsSync } from "node:fs";
import { join } from "node:path";
import type { ArtifactRow, BuildRow, Db, TemplateRow } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import type { Logger } from "../log.ts";
import type { MachineDriver } from "../runtime/driver.ts";
import type { TemplateService } from "../templates/service.ts";
import { DEFAULT_NAMESPACE, BASE_TEMPLATE_REF, parseTemplateRef } from "../templates/service.ts";
import type { BuildRequestT } from "./request.ts";
import { emptyCacheSummary, CACHE_COUNTER_SUFFIX } from "./enums.ts";
import type { BuildBackendName, BuildPhase, BuildStatus, SourceType } from "./enums.ts";
import { createBuildLogs } from "./log.ts";
import type { LogEntry, LogInput, LogSink } from "./log.ts";
import { createBlobStore } from "./context.ts";
import type { ContextFile } from "./context.ts";
import { planSteps } from "./steps/index.ts";
import { assembleDockerfile, sha256 } from "./dockerfile.ts";
import type { BuildBackend, DockerfileInput, PlannedStep } from "./backends/backend.ts";
import { createNativeBackend, MAX_LAYERS, stackFits, touchesFiles } from "./backends/native.ts";
import { createLayerCache } from "./cache/layers.ts";
import { contextDigest, sourceDigest } from "./cache/keys.ts";
import { templateBaseSource } from "./sources/template-base.ts";
import type { BuildSource, SourceLayers } from "./sources/source.ts";
import { emptyConfig } from "./sources/source.ts";
import type { ArtifactConfig } from "./artifact-config.ts";
import { artifactConfig } from "./artifact-config.ts";
import { selectContext } from "./context.ts";
import { verifyStartCommand } from "./phases/startup.ts";
import { BuildCancelled, BuildFailure } from "./failure.ts";
import { encodeCursor, pageAfter } from "../store/cursor.ts";
import { createBuildRetention } from "./retention.ts";
import type { OciCacheRetention } from "./oci/cache-retention.ts";

export const BUILD_DEFAULTS = { tags: ["default"], vcpus: 1, memoryMb: 1024, internet: true, maxAttempts: 3 } as const;

/** Where another room plugs in: an OCI importer for `base_image`, a backend for Dockerfile builds. */
export interface BuildExtensions {
  /** `log`/`count` carry the import's progress and its `layer` cache entries into the build's log and summary. */
  ociImport?: (
    ref: string,
    opts: { auth?: BuildRequestT["base_image_auth"]; signal: AbortSignal; dataDir: string; log: (entry: LogInput) => void; count: (counter: string) => void },
  ) => Promise<SourceLayers & { digest: string }>;
  /** The importer's layer and blob cache, collected with the build output it serves. */
  ociCache?: OciCacheRetention;
  /** `validate` runs before the stream: what the Dockerfile's request gets wrong is an HTTP error, not a build. */
  buildkit?: BuildBackend & { validate?(input: DockerfileInput, context: ContextFile[]): void };
}

/** Everything checked and resolved before the stream starts. */
interface PreparedBuild {
  buildId: string;
  template: TemplateRow;
  name: string;
  tags: string[];
  backend: BuildBackendName;
  sourceType: SourceType;
  request: BuildRequestT;
  source: BuildSource | null; // null: an OCI import the pipeline does first
  steps: PlannedStep[];
  context: ContextFile[];
  contextDigest: string;
  dockerfileDigest: string | null;
  dockerfile: string;
  triggeredBy: string | null;
}

export interface BuildListQuery {
  status?: BuildStatus;
  build_backend?: BuildBackendName;
  source_type?: SourceType;
  limit: number;
  cursor?: string;
}

function buildVm(req: BuildRequestT) {
  return { vcpus: req.vm?.vcpus ?? BUILD_DEFAULTS.vcpus, memoryMb: req.vm?.memory_mb ?? BUILD_DEFAULTS.memoryMb, internet: req.vm?.internet ?? BUILD_DEFAULTS.internet };
}

function hashToken(token: string): string {
  return createHash("sha256").update(token).digest("hex");
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
}) {
  const { db, templates, log } = deps;
  const logs = createBuildLogs({ db, log, maxBytes: deps.logMaxBytes });
  const blobs = createBlobStore(deps.dataDir);
  const layersDir = join(deps.dataDir, "layers");
  const layerCache = createLayerCache(db);
  const native = createNativeBackend({ driver: deps.driver, layerCache, layersDir, log });
  const running = new Map<string, { abort: AbortController; done: Promise<void> }>();
  const retention = createBuildRetention({ db, layersDir, retentionS: deps.retentionS, buildsRunning: () => running.size > 0, ociCache: deps.extensions?.ociCache });
  let collector: NodeJS.Timeout | undefined;
  /** Set by close(): builds stopped by a shutdown end `error` (the server stopped), not `cancelled`. */
  let shuttingDown = false;

  // ── before the stream ──────────────────────────────────────────────────────────────────────────────────────

  async function prepare(req: BuildRequestT, triggeredBy: string | null): Promise<PreparedBuild> {
    if (req.dockerfile && req.build_backend === "native") throw new KilnError("invalid_request", "A dockerfile build cannot use build_backend \"native\": Dockerfile builds use buildkit");
    if (req.dockerfile && req.steps?.length) throw new KilnError("invalid_request", "Give either dockerfile or steps, not both");
    if (req.dockerfile && req.base_image) throw new KilnError("invalid_request", "Give either dockerfile or base_image (a Dockerfile names its own FROM)");
    const backend: BuildBackendName = req.build_backend ?? (req.dockerfile ? "buildkit" : "native");
    if (!req.dockerfile && backend === "buildkit") throw new KilnError("invalid_request", "build_backend \"buildkit\" builds a dockerfile; declarative and base_image builds use native");
    if (backend === "native") {
      for (const f of ["secrets", "registry_credentials", "build_args", "target", "dockerfile_path"] as const) {
        if (req[f] !== undefined) throw new KilnError("invalid_request", `${f} applies to Dockerfile (buildkit) builds only`);
      }
    }
    if (req.dockerfile && !deps.extensions?.buildkit) throw new KilnError("build_rejected", "Dockerfile builds need the buildkit backend, which this server does not have");

    // Name precedence: name, then template_name, then alias, then a generated name.
    const explicitName = req.name ?? req.template_name;
    const rawName = explicitName ?? req.alias ?? `tpl-${newId("tpl").slice(-10)}`;
    const canonicalRef = parseTemplateRef(rawName).canonicalRef;
    const aliasRef = explicitName && req.alias ? `${DEFAULT_NAMESPACE}/${req.alias}` : null;
    if (aliasRef === canonicalRef) throw new KilnError("invalid_request", "alias must differ from the template's own name");
    if (canonicalRef === BASE_TEMPLATE_REF) throw new KilnError("conflict", `${BASE_TEMPLATE_REF} is made by Kiln itself and cannot be rebuilt`);

    // Context blobs: present and with the bytes their digest names (each lookup is a file_blob cache lookup).
    const context: ContextFile[] = [];
    const seen = new Set<string>();
    for (const f of req.context?.files ?? []) {
      if (seen.has(f.path)) throw new KilnError("invalid_request", `context.files names ${JSON.stringify(f.path)} twice`);
      seen.add(f.path);
      const state = await blobs.verify(f.sha256);
      if (state !== "ok") {
        throw new KilnError("invalid_request", state === "missing" ? `Context blob ${f.sha256} (${f.path}) is missing: upload it with PUT /v1/templates/blobs/${f.sha256}` : `Context blob ${f.sha256} (${f.path}) does not match its sha256: upload it again`, {
          detail: { code: "invalid_request", phase: "preparing", cache_subject: f.path, details: { sha256: f.sha256, reason: state } },
        });
      }
      context.push({ path: f.path, sha256: f.sha256, mode: f.mode, blobPath: blobs.pathOf(f.sha256) });
    }
    for (const step of req.steps ?? []) {
      if (step.type === "copy" && selectContext(context, step.src).length === 0) throw new KilnError("invalid_request", `copy step: ${JSON.stringify(step.src)} is not in context.files`);
    }
    if (req.dockerfile) deps.extensions?.buildkit?.validate?.(dockerfileInput(req)!, context);

    // The source: local/base, a Kiln template named by base_image (template_base), or an OCI image (oci_import).
    let source: BuildSource | null = null;
    let sourceType: SourceType = req.dockerfile ? "dockerfile" : "declarative";
    if (req.base_image) {
      const local = await resolveTemplate(req.base_image);
      if (local) {
        source = templateBaseSource(local, "template_base");
        sourceType = "template_base";
      } else {
        if (!deps.extensions?.ociImport) throw new KilnError("build_rejected", `base_image ${JSON.stringify(req.base_image)} is not a Kiln template, and this server cannot import OCI images`);
        sourceType = "oci_import";
      }
    } else if (!req.dockerfile) {
      source = templateBaseSource(await templates.resolve(BASE_TEMPLATE_REF), "declarative");
    } else {
      // A Dockerfile names its own FROM: the buildkit backend produces every layer.
      source = { type: "dockerfile", digest: sha256(""), description: req.dockerfile_path ?? "Dockerfile", layers: [], config: emptyConfig() };
    }

    const steps = planSteps(req.steps ?? [], source?.config.user ?? "root");
    const stack = (source?.layers.length ?? 0) + steps.filter(touchesFiles).length;
    if (!stackFits(source?.layers.map((l) => l.dir) ?? [], steps.filter(touchesFiles).length, layersDir)) {
      throw new KilnError("invalid_request", `This build would stack ${stack} layers; a template may have at most ${MAX_LAYERS} (merge steps, e.g. several commands in one run step)`);
    }
    const dockerfile = req.dockerfile ?? assembleDockerfile(req.base_image ?? BASE_TEMPLATE_REF, steps.map((s) => s.text));

    // Claim the name, or find it; an alias another template owns is a conflict. Nothing stream-related happened yet.
    const template = await claimTemplate(canonicalRef, aliasRef, req.name_claim_token);
    return {
      buildId: newId("bld"),
      template,
      name: template.canonical_ref,
      tags: req.tags ?? [...BUILD_DEFAULTS.tags],
      backend,
      sourceType,
      request: req,
      source,
      steps,
      context,
      contextDigest: contextDigest(context),
      dockerfileDigest: sha256(dockerfile),
      dockerfile,
      triggeredBy,
    };
  }

  async function resolveTemplate(ref: string) {
    try {
      return await templates.resolve(ref);
    } catch (err) {
      if (err instanceof KilnError && (err.code === "not_found" || err.code === "invalid_request")) return null;
      throw err;
    }
  }

  async function claimTemplate(canonicalRef: string, aliasRef: string | null, claimToken: string | undefined): Promise<TemplateRow> {
    return db.transaction().execute(async (tx) => {
      const now = new Date().toISOString();
      let template = await tx.selectFrom("templates").selectAll().where("canonical_ref", "=", canonicalRef).executeTakeFirst();
      const owner = await tx.selectFrom("template_aliases").select("template_id").where("alias_ref", "=", canonicalRef).executeTakeFirst();
      if (!template && owner) throw new KilnError("conflict", `${canonicalRef} is an alias of another template`);
      if (template?.name_claim_hash) {
        const given = claimToken ? Buffer.from(hashToken(claimToken)) : Buffer.alloc(64);
        if (!timingSafeEqual(given, Buffer.from(template.name_claim_hash))) throw new KilnError("conflict", `The name ${canonicalRef} is reserved by another name_claim_token`);
      }
      if (aliasRef) {
        const aliasOwner = await tx.selectFrom("template_aliases").select("template_id").where("alias_ref", "=", aliasRef).executeTakeFirst();
        const aliasTemplate = await tx.selectFrom("templates").select("id").where("canonical_ref", "=", aliasRef).executeTakeFirst();
        if (aliasTemplate || (aliasOwner && aliasOwner.template_id !== template?.id)) throw new KilnError("conflict", `The alias ${aliasRef} belongs to another template`);
      }
      if (!template) {
        const [namespace, name] = canonicalRef.split("/");
        template = { id: newId("tpl"), namespace, name, canonical_ref: canonicalRef, created_at: now, updated_at: now, name_claim_hash: claimToken ? hashToken(claimToken) : null };
        await tx.insertInto("templates").values(template).execute();
      }
      if (aliasRef) {
        const mine = await tx.selectFrom("template_aliases").select("alias_ref").where("alias_ref", "=", aliasRef).executeTakeFirst();
        if (!mine) await tx.insertInto("template_aliases").values({ alias_ref: aliasRef, template_id: template.id, created_at: now }).execute();
      }
      return template;
    });
  }

  // ── the pipeline ───────────────────────────────────────────────────────────────────────────────────────────

  /** Records the build and starts it; the caller follows its log. A dropped follower never stops it. */
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

  async function pipeline(p: PreparedBuild, signal: AbortSignal): Promise<void> {
    const started = Date.now();
    const summary = emptyCacheSummary();
    let phase: BuildPhase = "preparing";
    const total = p.steps.length;
    const emit = (e: LogInput) => {
      if (e.phase) phase = e.phase;
      const entry: LogEntry = { level: "info", ...e, timestamp: new Date().toISOString(), build_id: p.buildId, template_id: p.template.id } as LogEntry;
      logs.append(p.buildId, entry);
    };
    const count = (c: string) => {
      summary[c] = (summary[c] ?? 0) + 1;
    };
    emit({ kind: "start", phase: "preparing", message: `building ${p.name} (${p.sourceType}, ${p.backend}) with ${total} step${total === 1 ? "" : "s"}, tags ${p.tags.join(", ")}`, total_steps: total });
    let status: BuildStatus = "error";
    let failurePhase: BuildPhase | null = null;
    let failureReason: string | null = null;
    let artifactIds: string[] = [];
    let srcDigest: string | null = null;
    try {
      for (const f of p.context) {
        count("file_blob_hits");
        emit({ kind: "cache", phase: "cache", cache_layer: "file_blob", cache_outcome: "hit", cache_target: f.path, message: `context file ${f.path} present`, level: "debug" });
      }
      let source = p.source;
      if (!source) {
        emit({ kind: "message", phase: "preparing", message: `importing ${p.request.base_image}` });
        const imported = await deps.extensions!.ociImport!(p.request.base_image!, { auth: p.request.base_image_auth, signal, dataDir: deps.dataDir, log: emit, count });
        source = { ...imported, type: "oci_import", description: p.request.base_image! };
      }
      const req = p.request;
      srcDigest = sourceDigest({ sourceDigest: source.digest, dockerfile: p.dockerfile, contextDigest: p.contextDigest, startCmd: req.start_cmd, readyCmd: req.ready_cmd, runtimeDefaults: req.runtime_defaults });
      await db.updateTable("builds").set({ source_digest: srcDigest }).where("id", "=", p.buildId).execute();

      const reused = req.skip_cache ? null : await findArtifact(srcDigest);
      if (req.skip_cache) {
        count("final_artifact_bypasses");
        emit({ kind: "cache", phase: "cache", cache_layer: "final_artifact", cache_outcome: "bypass", cache_reason: "whole_build_skip_cache", cache_target: p.name, message: "skip_cache: every step runs" });
      } else {
        count(reused ? "final_artifact_hits" : "final_artifact_misses");
        emit(
          reused
            ? { kind: "cache", phase: "cache", cache_layer: "final_artifact", cache_outcome: "hit", cache_target: p.name, message: `cache hit: artifact ${reused.id} was built from the same input; no step runs` }
            : { kind: "cache", phase: "cache", cache_layer: "final_artifact", cache_outcome: "miss", cache_reason: "missing_or_incompatible", cache_target: p.name, message: "no artifact was built from this input yet" },
        );
      }

      let artifactId: string;
      if (reused) {
        artifactId = await reuseArtifact(reused, p);
      } else {
        const backend = p.backend === "native" ? native : deps.extensions!.buildkit!;
        const out = await backend.run({
          buildId: p.buildId,
          source,
          steps: p.steps,
          context: p.context,
          dockerfile: dockerfileInput(req),
          buildEnvs: req.build_envs ?? {},
          vm: buildVm(req),
          skipCache: req.skip_cache === true,
          maxAttempts: BUILD_DEFAULTS.maxAttempts,
          signal,
          log: emit,
          count,
          logBackpressure: () => logs.backpressure(p.buildId),
        });
        if (signal.aborted) throw new BuildCancelled();
        emit({ kind: "message", phase: "finalize", message: "recording the artifact" });
        const layers = [...source.layers, ...out.layers];
        const image = { ...out.config, env: { ...out.config.env, ...(req.runtime_defaults?.envs ?? {}) } };
        if (req.runtime_defaults?.cwd) image.workingDir = req.runtime_defaults.cwd;
        if (req.runtime_defaults?.user) image.user = req.runtime_defaults.user;
        const config: ArtifactConfig = { image, layerDigests: layers.map((l) => l.digest), runtimeDefaults: req.runtime_defaults, startCmd: req.start_cmd, readyCmd: req.ready_cmd };
        if (config.startCmd) {
          // Kept beside the layers and removed by retention with the artifact that names it.
          const checkpointDir = join(layersDir, `checkpoint-${p.buildId}`);
          config.checkpoint = await verifyStartCommand({ driver: deps.driver, layers: layers.map((l) => l.dir), config, vm: buildVm(req), log: emit, checkpointDir });
          if (signal.aborted) throw new BuildCancelled();
        }
        artifactId = await recordArtifact(p, layers.map((l) => l.dir), config, srcDigest);
        count("final_artifact_stores");
        emit({ kind: "cache", phase: "finalize", cache_layer: "final_artifact", cache_outcome: "stored", cache_target: p.name, message: `artifact ${artifactId} stored`, level: "debug" });
      }
      artifactIds = [artifactId];
      status = "ready";
      await finish(p, { status, artifactIds, summary, started, srcDigest });
      emit({ kind: "end", phase: "finalize", message: `${p.name} is ready: ${artifactId} tagged ${p.tags.join(", ")} in ${Date.now() - started} ms`, metadata: { artifact_id: artifactId, cache_summary: summary } });
    } catch (err) {
      if ((err instanceof BuildCancelled || signal.aborted) && !shuttingDown) {
        status = "cancelled";
        failurePhase = phase;
        failureReason = "cancelled";
        await finish(p, { status, artifactIds, summary, started, srcDigest, failurePhase, failureReason });
        emit({ kind: "cancelled", level: "warn", phase: "cleanup", message: "the build was cancelled; everything it was running was stopped" });
      } else {
        const f = err instanceof BuildFailure ? err : null;
        if (!f && !shuttingDown) log.error({ err, build_id: p.buildId }, "build failed unexpectedly");
        failurePhase = f?.phase ?? phase;
        failureReason = shuttingDown ? "the server stopped during the build" : (f?.message ?? (err instanceof KilnError ? err.message : "internal error in the build pipeline"));
        await finish(p, { status: "error", artifactIds, summary, started, srcDigest, failurePhase, failureReason });
        emit({
          kind: "error",
          level: "error",
          phase: failurePhase,
          step_index: f?.stepIndex,
          total_steps: f?.stepIndex ? total : undefined,
          message: failureReason,
          error_detail: {
            code: "build_error",
            message: failureReason,
            phase: failurePhase,
            step_index: f?.stepIndex,
            retryable: f?.retryable ?? true,
            suggested_action: f?.suggestedAction ?? "retry the build; if it fails again, report it with the build id",
            build_id: p.buildId,
          },
        });
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

  /** An artifact built from the same input whose layers are all still on disk. */
  async function findArtifact(srcDigest: string) {
    const rows = await db.selectFrom("artifacts").selectAll().where("source_digest", "=", srcDigest).orderBy("created_at", "desc").execute();
    return rows.find((a) => (JSON.parse(a.layers_json) as string[]).every((d) => existsSync(d))) ?? null;
  }

  async function reuseArtifact(a: ArtifactRow, p: PreparedBuild): Promise<string> {
    if (a.template_id === p.template.id) {
      await moveTags(p, a.id);
      return a.id;
    }
    return recordArtifact(p, JSON.parse(a.layers_json) as string[], artifactConfig(a), a.source_digest ?? null);
  }

  async function recordArtifact(p: PreparedBuild, layers: string[], config: ArtifactConfig, srcDigest: string | null): Promise<string> {
    const id = newId("art");
    const now = new Date().toISOString();
    const digest = sha256(JSON.stringify({ layers: config.layerDigests ?? layers, image: config.image, start: config.startCmd ?? null, ready: config.readyCmd ?? null }));
    await db.insertInto("artifacts").values({ id, template_id: p.template.id, build_id: p.buildId, layers_json: JSON.stringify(layers), digest, created_at: now, config_json: JSON.stringify(config), source_digest: srcDigest, retention_expires_at: null }).execute();
    await moveTags(p, id);
    return id;
  }

  /** Points the build's tags at the artifact; artifacts left with no tag start their retention clock. */
  async function moveTags(p: PreparedBuild, artifactId: string) {
    const now = new Date().toISOString();
    const expires = new Date(Date.now() + deps.retentionS * 1000).toISOString();
    await db.transaction().execute(async (tx) => {
      const before = await tx.selectFrom("artifact_tags").select(["tag", "artifact_id"]).where("template_id", "=", p.template.id).execute();
      for (const tag of p.tags) {
        if (before.some((b) => b.tag === tag)) await tx.updateTable("artifact_tags").set({ artifact_id: artifactId, updated_at: now }).where("template_id", "=", p.template.id).where("tag", "=", tag).execute();
        else await tx.insertInto("artifact_tags").values({ template_id: p.template.id, tag, artifact_id: artifactId, updated_at: now }).execute();
      }
      await tx.updateTable("artifacts").set({ retention_expires_at: null }).where("id", "=", artifactId).execute();
      for (const old of new Set(before.map((b) => b.artifact_id))) {
        if (old === artifactId) continue;
        const still = await tx.selectFrom("artifact_tags").select("tag").where("artifact_id", "=", old).executeTakeFirst();
        if (!still) await tx.updateTable("artifacts").set({ retention_expires_at: expires }).where("id", "=", old).where("retention_expires_at", "is", null).execute();
      }
      await tx.updateTable("templates").set({ updated_at: now }).where("id", "=", p.template.id).execute();
    });
  }

  // ── records, history, logs, cancel ─────────────────────────────────────────────────────────────────────────

  async function view(row: BuildRow) {
    const artifactIds = JSON.parse(row.artifact_ids_json) as string[];
    const artifact = artifactIds[0] ? await db.selectFrom("artifacts").selectAll().where("id", "=", artifactIds[0]).executeTakeFirst() : undefined;
    let availability: { status: string; reason: string };
    if (row.status === "building" || row.status === "waiting") availability = { status: "pending", reason: "the build is still running" };
    else if (row.status !== "ready") availability = { status: "unavailable", reason: row.status === "cancelled" ? "the build was cancelled" : "the build failed and produced no artifact" };
    else if (!artifact || !(JSON.parse(artifact.layers_json) as string[]).every((d) => existsSync(d))) availability = { status: "expired", reason: "the artifact's layers were removed by retention" };
    else availability = { status: "available", reason: artifact.retention_expires_at ? "no tag points at it any more; kept until retention_expires_at" : "tagged and on disk" };
    const promotable = availability.status === "available";
    return {
      build_id: row.id,
      template_id: row.template_id,
      name: row.name,
      tags: JSON.parse(row.tags_json) as string[],
      status: row.status as BuildStatus,
      build_backend: row.build_backend as BuildBackendName,
      source_type: row.source_type as SourceType,
      created_at: row.created_at,
      updated_at: row.updated_at,
      source_digest: row.source_digest,
      context_digest: row.context_digest,
      dockerfile_digest: row.dockerfile_digest,
      triggered_by: row.triggered_by,
      queued_at: row.queued_at,
      started_at: row.started_at,
      finished_at: row.finished_at,
      duration_ms: row.duration_ms === null ? null : Number(row.duration_ms),
      failure_phase: row.failure_phase,
      cache_summary: JSON.parse(row.cache_summary_json) as Record<string, number>,
      artifact_availability: availability,
      promotability: { status: promotable ? "promotable" : "not_promotable", promotable, reason: promotable ? "a ready build whose artifact is available" : availability.reason },
      retention_expires_at: artifact?.retention_expires_at ?? null,
      artifact_ids: artifactIds,
    };
  }
  type BuildView = Awaited<ReturnType<typeof view>>;

  /** `id` is an artifact id, a template id or a (legacy unnamespaced, canonical or alias) ref. */
  async function templateIdOf(id: string): Promise<string> {
    if (id.startsWith("tpl_")) {
      const t = await db.selectFrom("templates").select("id").where("id", "=", id).executeTakeFirst();
      if (t) return t.id;
    } else if (id.startsWith("art_")) {
      const a = await db.selectFrom("artifacts").select("template_id").where("id", "=", id).executeTakeFirst();
      if (a) return a.template_id;
    } else {
      let canonicalRef: string | undefined;
      try {
        canonicalRef = parseTemplateRef(id).canonicalRef;
      } catch {
        canonicalRef = undefined;
      }
      if (canonicalRef) {
        const t = await db.selectFrom("templates").select("id").where("canonical_ref", "=", canonicalRef).executeTakeFirst();
        if (t) return t.id;
        const a = await db.selectFrom("template_aliases").select("template_id").where("alias_ref", "=", canonicalRef).executeTakeFirst();
        if (a) return a.template_id;
      }
    }
    throw new KilnError("not_found", `No template ${JSON.stringify(id)}`);
  }

  async function list(id: string, q: BuildListQuery): Promise<{ builds: BuildView[]; next_cursor: string | null }> {
    const templateId = await templateIdOf(id);
    let query = db.selectFrom("builds").selectAll().where("template_id", "=", templateId).orderBy("created_at", "desc").orderBy("id", "desc").limit(q.limit + 1);
    if (q.status) query = query.where("status", "=", q.status);
    if (q.build_backend) query = query.where("build_backend", "=", q.build_backend);
    if (q.source_type) query = query.where("source_type", "=", q.source_type);
    const after = pageAfter(q.cursor);
    if (after) {
      query = query.where((eb) => eb.or([eb("created_at", "<", after[0]), eb.and([eb("created_at", "=", after[0]), eb("id", "<", after[1])])]));
    }
    const rows = await query.execute();
    const page = rows.slice(0, q.limit);
    const last = page.at(-1);
    return { builds: await Promise.all(page.map(view)), next_cursor: rows.length > q.limit && last ? encodeCursor([last.created_at, last.id]) : null };
  }

  async function loadBuild(id: string, buildId: string): Promise<BuildRow> {
    const templateId = await templateIdOf(id);
    const row = await db.selectFrom("builds").selectAll().where("id", "=", buildId).where("template_id", "=", templateId).executeTakeFirst();
    if (!row) throw new KilnError("not_found", `No build ${buildId} of template ${id}`);
    return row;
  }

  async function get(id: string, buildId: string): Promise<BuildView> {
    return view(await loadBuild(id, buildId));
  }

  async function cancel(id: string, buildId: string): Promise<BuildView> {
    const row = await loadBuild(id, buildId);
    const run = running.get(buildId);
    if (!run) {
      if (row.status === "building" || row.status === "waiting") throw new KilnError("conflict", `Build ${buildId} is not running in this server`);
      throw new KilnError("conflict", `Build ${buildId} already ended ${row.status}`, { buildId });
    }
    run.abort.abort();
    await run.done;
    return view(await loadBuild(id, buildId));
  }

  /** The build's log from after `lastEventId`, then live entries until its terminal one, at the sink's pace. */
  function follow(buildId: string, lastEventId: number, sink: LogSink) {
    return logs.follow(buildId, lastEventId, sink);
  }

  async function aliases(ref: string): Promise<{ alias_ref: string; created_at: string }[]> {
    let canonicalRef: string;
    try {
      canonicalRef = parseTemplateRef(ref).canonicalRef;
    } catch {
      throw new KilnError("not_found", `No template ${JSON.stringify(ref)}`);
    }
    const t = await db.selectFrom("templates").select("id").where("canonical_ref", "=", canonicalRef).executeTakeFirst();
    if (!t) throw new KilnError("not_found", `No template ${JSON.stringify(ref)}`);
    return db.selectFrom("template_aliases").select(["alias_ref", "created_at"]).where("template_id", "=", t.id).orderBy("alias_ref").execute();
  }

  // ── restart recovery and retention ─────────────────────────────────────────────────────────────────────────

  /** Builds a previous process left running end `error`, with the phase they were in, and their log says so. */
  async function recoverInterrupted(): Promise<number> {
    const rows = await db.selectFrom("builds").selectAll().where("status", "in", ["waiting", "building"]).execute();
    for (const row of rows) {
      if (running.has(row.id)) continue;
      const last = await db.selectFrom("build_logs").select(["seq", "entry_json"]).where("build_id", "=", row.id).orderBy("seq", "desc").limit(1).executeTakeFirst();
      const lastEntry = last ? (JSON.parse(last.entry_json) as LogEntry) : undefined;
      const phase = lastEntry?.phase ?? "preparing";
      const reason = "the server stopped during the build";
      const now = new Date().toISOString();
      await db.updateTable("builds").set({ status: "error", failure_phase: phase, failure_reason: reason, finished_at: now, updated_at: now, duration_ms: Date.now() - Date.parse(row.started_at ?? row.queued_at) }).where("id", "=", row.id).execute();
      const entry: LogEntry = {
        kind: "error",
        level: "error",
        message: reason,
        timestamp: now,
        build_id: row.id,
        template_id: row.template_id,
        phase,
        step_index: lastEntry?.step_index,
        error_detail: { code: "build_error", message: reason, phase, step_index: lastEntry?.step_index, retryable: true, suggested_action: "build again", build_id: row.id },
      };
      await db.insertInto("build_logs").values({ build_id: row.id, seq: Number(last?.seq ?? 0) + 1, kind: "error", entry_json: JSON.stringify(entry) }).execute();
    }
    return rows.length;
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
  }

  return { prepare, start, list, get, cancel, follow, aliases, blobs, recoverInterrupted, collect: retention.collect, startCollector, close, templateIdOf, isLive: logs.isLive };
}

export type BuildService = ReturnType<typeof createBuildService>;
export { CACHE_COUNTER_SUFFIX };

/** A Dockerfile build's inputs as the buildkit backend takes them (undefined for other builds). */
function dockerfileInput(req: BuildRequestT): DockerfileInput | undefined {
  if (!req.dockerfile) return undefined;
  return { text: req.dockerfile, path: req.dockerfile_path, buildArgs: req.build_args, target: req.target, secrets: req.secrets, registryCredentials: req.registry_credentials, baseImageAuth: req.base_image_auth };
}
