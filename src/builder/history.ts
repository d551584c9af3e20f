// Build records as SPEC.md shows them (artifact_availability, promotability), the history of a template's builds
// (filtered, newest first, keyset-paged) and a template's aliases.

import { existsSync } from "node:fs";
import type { ArtifactRow, BuildRow, Db } from "../store/schema.ts";
import { KilnError } from "../errors.ts";
import { findTemplate, parseTemplateRef, templateIdOf } from "../templates/resolver.ts";
import type { BuildBackendName, BuildStatus, SourceType } from "./enums.ts";
import type { PageKey } from "../store/pages.ts";
import { newestFirstPage } from "../store/pages.ts";

export interface BuildListQuery {
  status?: BuildStatus;
  build_backend?: BuildBackendName;
  source_type?: SourceType;
  limit: number;
  after?: PageKey;
}

/** The cluster's answer to "are an artifact's layers still held somewhere" (undefined: judge by this disk). */
export type ClusterAvailability = (artifact: ArtifactRow) => Promise<boolean | undefined>;

export function createBuildHistory(db: Db, inCluster?: ClusterAvailability) {
  async function view(row: BuildRow) {
    const artifactIds = JSON.parse(row.artifact_ids_json) as string[];
    const artifact = artifactIds[0] ? await db.selectFrom("artifacts").selectAll().where("id", "=", artifactIds[0]).executeTakeFirst() : undefined;
    let availability: { status: string; reason: string };
    if (row.status === "building" || row.status === "waiting") availability = { status: "pending", reason: "the build is still running" };
    else if (row.status !== "ready") availability = { status: "unavailable", reason: row.status === "cancelled" ? "the build was cancelled" : "the build failed and produced no artifact" };
    else if (!artifact || !((await inCluster?.(artifact)) ?? (JSON.parse(artifact.layers_json) as string[]).every((d) => existsSync(d)))) availability = { status: "expired", reason: "the artifact's layers were removed by retention" };
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
      host_id: row.host_id,
    };
  }

  async function list(id: string, q: BuildListQuery) {
    const templateId = await templateIdOf(db, id);
    let query = db.selectFrom("builds").selectAll().where("template_id", "=", templateId);
    if (q.status) query = query.where("status", "=", q.status);
    if (q.build_backend) query = query.where("build_backend", "=", q.build_backend);
    if (q.source_type) query = query.where("source_type", "=", q.source_type);
    const page = await newestFirstPage(query, q);
    return { builds: await Promise.all(page.rows.map(view)), last: page.last, more: page.more };
  }

  async function loadBuild(id: string, buildId: string): Promise<BuildRow> {
    const templateId = await templateIdOf(db, id);
    const row = await db.selectFrom("builds").selectAll().where("id", "=", buildId).where("template_id", "=", templateId).executeTakeFirst();
    if (!row) throw new KilnError("not_found", `No build ${buildId} of template ${id}`);
    return row;
  }

  async function aliases(ref: string): Promise<{ alias_ref: string; created_at: string }[]> {
    let canonicalRef: string;
    try {
      canonicalRef = parseTemplateRef(ref).canonicalRef;
    } catch {
      throw new KilnError("not_found", `No template ${JSON.stringify(ref)}`);
    }
    const t = await findTemplate(db, canonicalRef, { ownNameOnly: true });
    if (!t) throw new KilnError("not_found", `No template ${JSON.stringify(ref)}`);
    return db.selectFrom("template_aliases").select(["alias_ref", "created_at"]).where("template_id", "=", t.id).orderBy("alias_ref").execute();
  }

  return { view, list, loadBuild, aliases };
}

export type BuildView = Awaited<ReturnType<ReturnType<typeof createBuildHistory>["view"]>>;
