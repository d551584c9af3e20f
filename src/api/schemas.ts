// Schemas shared by several routes. Each is at once the validator, the TypeScript type and the OpenAPI entry.
// Enums come from the services that own them, never restated here.

import { Type } from "typebox";
import type { Static, TSchema } from "typebox";
import { HIBERNATE_MODES, MACHINE_STATUSES, ON_TIMEOUT } from "../machines/service.ts";
import { ENV_NAME, INPUT_LIMITS, NO_NUL } from "../machines/input-limits.ts";
import { LIST_DEFAULT_LIMIT, LIST_MAX_LIMIT } from "../agent/list-pages.ts";

export const ErrorEnvelope = Type.Object(
  {
    error: Type.String(),
    code: Type.String(),
    request_id: Type.String(),
    error_detail: Type.Optional(Type.Object({}, { additionalProperties: true })),
    build_id: Type.Optional(Type.String()),
  },
  { $id: "ErrorEnvelope" },
);

/** Standard error responses for an authenticated route, so the OpenAPI document lists them. */
export function errors(...statuses: number[]): Record<number, TSchema> {
  const out: Record<number, TSchema> = { 401: ErrorEnvelope };
  for (const s of statuses) out[s] = ErrorEnvelope;
  return out;
}

export const StringMap = Type.Record(Type.String(), Type.String());

/** A string that may reach a path, argv, env or cwd: no NUL byte (SPEC-level 400 invalid_request, never a 500). */
export function NoNul(opts: { minLength?: number; maxLength?: number; description?: string } = {}) {
  return Type.String({ ...opts, pattern: NO_NUL });
}

/** Environment variables for a process: POSIX names, NUL-free values, bounded (totals in input-limits.ts). */
export const Envs = Type.Record(Type.String({ pattern: ENV_NAME, maxLength: INPUT_LIMITS.envNameChars }), NoNul({ maxLength: INPUT_LIMITS.envValueChars }), {
  additionalProperties: false,
  maxProperties: INPUT_LIMITS.envKeys,
});

/** Free-form labels on a machine: bounded in keys and sizes (total in input-limits.ts). */
export const Metadata = Type.Record(Type.String(), Type.String({ maxLength: INPUT_LIMITS.metadataValueChars }), {
  maxProperties: INPUT_LIMITS.metadataKeys,
  propertyNames: { maxLength: INPUT_LIMITS.metadataKeyChars },
});

export const Id = Type.String({ minLength: 1, maxLength: 64, pattern: "^[A-Za-z0-9_-]+$" });

export const Limit = Type.Integer({ minimum: 1, maximum: 100, default: 50 });
export const Cursor = Type.String({ minLength: 1, maxLength: 512 });

export const Machine = Type.Object({
  id: Type.String(),
  template_id: Type.String(),
  artifact_id: Type.String(),
  name: Type.Union([Type.String(), Type.Null()]),
  status: Type.Enum(MACHINE_STATUSES),
  cwd: Type.Union([Type.String(), Type.Null()]),
  user: Type.String(),
  vcpus: Type.Integer(),
  memory_mb: Type.Integer(),
  disk_mb: Type.Integer(),
  internet: Type.Boolean(),
  network: Type.Object({ allow_out: Type.Array(Type.String()), deny_out: Type.Array(Type.String()) }),
  timeout_s: Type.Integer(),
  created_at: Type.String({ format: "date-time" }),
  updated_at: Type.String({ format: "date-time" }),
  expires_at: Type.String({ format: "date-time" }),
  destroyed_at: Type.Union([Type.String({ format: "date-time" }), Type.Null()]),
  failure_reason: Type.Union([Type.String(), Type.Null()]),
  metadata: StringMap,
  on_timeout: Type.Enum(ON_TIMEOUT, { description: "What its timeout does: destroy it, or hibernate it (until KILN_MAX_HIBERNATION_S)" }),
  auto_resume: Type.Boolean({ description: "A hibernated machine wakes on the next exec, files, WebSocket, port or edge request" }),
  hibernate_mode: Type.Union([Type.Enum(HIBERNATE_MODES), Type.Null()], { description: "How a hibernated machine sleeps; null unless hibernated" }),
  snapshot_id: Type.Union([Type.String(), Type.Null()], { description: "The snapshot it was made from" }),
  host_id: Type.Union([Type.String(), Type.Null()], { description: "The host it runs on (GET /v1/hosts/{id}); null for a record made before hosts existed" }),
});

export const FileMetadata = Type.Object({
  name: Type.String(),
  path: Type.String(),
  is_dir: Type.Boolean(),
  size: Type.Integer(),
  type: Type.Union([Type.Literal("file"), Type.Literal("directory"), Type.Literal("symlink")]),
  mode: Type.String(),
  permissions: Type.String(),
  owner: Type.String(),
  group: Type.String(),
  modified_time: Type.String({ format: "date-time" }),
  symlink_target: Type.Optional(Type.String()),
});

/** files/list (machines and volumes): how deep, how many entries per answer, and where the next page starts. */
export const ListDepth = Type.Integer({ minimum: 1, maximum: 10, default: 1 });
export const ListLimit = Type.Integer({ minimum: 1, maximum: LIST_MAX_LIMIT, default: LIST_DEFAULT_LIMIT });
export const ListCursor = Type.String({ minLength: 1, maxLength: 65_536 });
export const FileListPage = Type.Object({ entries: Type.Array(FileMetadata), next_cursor: Type.Union([Type.String(), Type.Null()]) });

export const MachinePath = NoNul({ minLength: 1, maxLength: INPUT_LIMITS.pathChars });
export const UserName = Type.String({ minLength: 1, maxLength: 64, pattern: "^[A-Za-z0-9_][A-Za-z0-9_.-]*\\$?$" });
export const OctalMode = Type.String({ pattern: "^[0-7]{3,4}$" });

export type MachineT = Static<typeof Machine>;
