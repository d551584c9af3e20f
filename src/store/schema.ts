// Table shapes of Kiln's store, shared by the SQLite and PostgreSQL dialects.
// Portable column types only: text, integer, bigint; timestamps are ISO 8601 UTC text, JSON is text, booleans are 0/1.

import type { Generated, Insertable, Kysely, Selectable, Updateable } from "kysely";

export interface ApiKeysTable {
  id: string; // key_…
  name: string;
  /** First characters of the key, shown by `kiln keys list` so people can tell keys apart. */
  prefix: string;
  /** Hex SHA-256 of the whole key. The key itself is never stored. */
  hash: string;
  created_at: string;
  last_used_at: string | null;
  revoked_at: string | null;
}

export interface TemplatesTable {
  id: string; // tpl_…
  namespace: string;
  name: string;
  canonical_ref: string; // "<namespace>/<name>", unique
  created_at: string;
  updated_at: string;
}

export interface TemplateAliasesTable {
  alias_ref: string; // "<namespace>/<alias>", primary key
  template_id: string;
  created_at: string;
}

export interface ArtifactsTable {
  id: string; // art_…
  template_id: string;
  build_id: string | null;
  /** Host directory of the artifact's read-only root layer(s), JSON array, lowest first. */
  layers_json: string;
  digest: string;
  created_at: string;
}

export interface ArtifactTagsTable {
  template_id: string;
  tag: string;
  artifact_id: string;
  updated_at: string;
}

export interface MachinesTable {
  id: string; // mch_…
  template_id: string;
  artifact_id: string;
  name: string | null;
  status: string; // creating | running | hibernated | destroyed | failed
  cwd: string | null;
  user: string;
  metadata_json: string;
  vcpus: number;
  memory_mb: number;
  disk_mb: Generated<number>;
  internet: number;
  /** `{allow_out?, deny_out?}` as given on create, or null. */
  network_json: string | null;
  timeout_s: number;
  expires_at: string;
  created_at: string;
  updated_at: string;
  destroyed_at: string | null;
  failure_reason: string | null;
}

export interface EventsTable {
  /** Insertion order; the outbox reads events in this order. */
  seq: Generated<number>;
  id: string; // evt_…
  operation: string; // create | update | hibernate | resume | destroy
  machine_id: string;
  /** The webhook payload, JSON: {id, operation, occurred_at, machine}. */
  payload_json: string;
  occurred_at: string;
}

export interface Database {
  api_keys: ApiKeysTable;
  templates: TemplatesTable;
  template_aliases: TemplateAliasesTable;
  artifacts: ArtifactsTable;
  artifact_tags: ArtifactTagsTable;
  machines: MachinesTable;
  events: EventsTable;
}

export type Db = Kysely<Database>;
export type MachineRow = Selectable<MachinesTable>;
export type NewMachine = Insertable<MachinesTable>;
export type MachineUpdate = Updateable<MachinesTable>;
export type ApiKeyRow = Selectable<ApiKeysTable>;
export type TemplateRow = Selectable<TemplatesTable>;
export type ArtifactRow = Selectable<ArtifactsTable>;
export type EventRow = Selectable<EventsTable>;
