// What clients read about deployments: the deployment, version and service-instance views of SPEC.md, made from
// store rows (a service's public_url is made by the edge for each read and handed in; it is never stored).

import type { Db, DeploymentRow, DeploymentVersionRow, ServiceRow } from "../store/schema.ts";
import type { ReadinessDetail, ServiceStatus } from "./lifecycle.ts";
import type { AccessMode } from "./schemas.ts";

export const DEPLOYMENT_STATUSES = ["active", "deleting", "deleted"] as const;
export const ROLLOUT_STATUSES = ["idle", "rolling", "failed"] as const;
export type RolloutStatus = (typeof ROLLOUT_STATUSES)[number];

export const READINESS_DEFAULTS = { intervalS: 2, timeoutS: 2 } as const;

/** A version's readiness settings, as stored (defaults filled in). */
export interface Readiness {
  path?: string;
  interval_s: number;
  timeout_s: number;
}

export function readinessOfVersion(v: DeploymentVersionRow): Readiness {
  return JSON.parse(v.readiness_json) as Readiness;
}

export function versionView(v: DeploymentVersionRow) {
  return {
    id: v.id,
    number: v.number,
    template: v.template,
    command: v.command,
    port: v.port,
    env_names: JSON.parse(v.env_names_json) as string[],
    readiness: readinessOfVersion(v),
    created_at: v.created_at,
  };
}

/** The agent service instance of SPEC.md; `detail` is the readiness detail to show (stored, or newer live probes). */
export function serviceView(row: ServiceRow, publicUrl: string | null, detail: ReadinessDetail) {
  return {
    id: row.id,
    deployment_id: row.deployment_id,
    version_id: row.version_id,
    status: row.status as ServiceStatus,
    port: row.port,
    created_at: row.created_at,
    updated_at: row.updated_at,
    machine_id: row.machine_id,
    process_id: row.process_id,
    public_url: publicUrl,
    readiness_status: detail,
    failure_reason: row.failure_reason,
    started_at: row.started_at,
    stopped_at: row.stopped_at,
    idempotency_key: row.idempotency_key,
  };
}
export type ServiceView = ReturnType<typeof serviceView>;

/** `edgeUrl` is the deployment's own public URL as the edge makes it for this read (never stored). */
export async function deploymentView(db: Db, row: DeploymentRow, withVersions: boolean, edgeUrl: string | null) {
  const versions = await db.selectFrom("deployment_versions").selectAll().where("deployment_id", "=", row.id).orderBy("number", "desc").execute();
  const current = versions.find((v) => v.id === row.current_version_id)!;
  const cv = versionView(current);
  return {
    id: row.id,
    name: row.name,
    status: row.status as (typeof DEPLOYMENT_STATUSES)[number],
    current_version_id: row.current_version_id,
    version: current.number,
    template: cv.template,
    command: cv.command,
    port: cv.port,
    env_names: cv.env_names,
    readiness: cv.readiness,
    replicas: row.replicas,
    public_url: row.public_url === 1,
    access: row.access as AccessMode,
    edge_url: edgeUrl,
    rollout_status: row.rollout_status as RolloutStatus,
    rollout_error: row.rollout_error,
    created_at: row.created_at,
    updated_at: row.updated_at,
    deleted_at: row.deleted_at,
    ...(withVersions ? { versions: versions.map(versionView) } : {}),
  };
}
export type DeploymentView = Awaited<ReturnType<typeof deploymentView>>;
