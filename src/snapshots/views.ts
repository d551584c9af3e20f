// The snapshot record as the API shows it: its schema (validator, type and OpenAPI entry at once) and the one
// mapping from a stored row. Host paths, runtime names and the shape a restore needs stay out of it.

import { Type } from "typebox";
import type { SnapshotRow } from "../store/schema.ts";

export const SNAPSHOT_STATUSES = ["creating", "ready", "failed", "deleted"] as const;
export type SnapshotStatus = (typeof SNAPSHOT_STATUSES)[number];

export const Snapshot = Type.Object({
  id: Type.String({ description: "snp_…" }),
  machine_id: Type.String({ description: "The machine it was taken of" }),
  template_id: Type.String(),
  name: Type.Union([Type.String(), Type.Null()]),
  memory: Type.Boolean({ description: "Whether the machine's processes were saved too (gVisor)" }),
  size_bytes: Type.Integer({ description: "Bytes it holds on its host: the disk image's blocks (shared with the machine until either writes) and the saved memory" }),
  disk_mb: Type.Integer({ description: "The disk size machines made from it have" }),
  status: Type.Enum(SNAPSHOT_STATUSES),
  created_at: Type.String({ format: "date-time" }),
  deleted_at: Type.Union([Type.String({ format: "date-time" }), Type.Null()]),
  failure_reason: Type.Union([Type.String(), Type.Null()]),
  metadata: Type.Record(Type.String(), Type.String()),
});

export function snapshotView(row: SnapshotRow) {
  return {
    id: row.id,
    machine_id: row.machine_id,
    template_id: row.template_id,
    name: row.name,
    memory: row.memory === 1,
    size_bytes: Number(row.size_bytes),
    disk_mb: row.disk_mb,
    status: row.status as SnapshotStatus,
    created_at: row.created_at,
    deleted_at: row.deleted_at,
    failure_reason: row.failure_reason,
    metadata: JSON.parse(row.metadata_json) as Record<string, string>,
  };
}
export type SnapshotView = ReturnType<typeof snapshotView>;
