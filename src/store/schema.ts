// Table shapes of Kiln's store, shared by the SQLite and PostgreSQL dialects.
// Portable column types only: text, integer, bigint; timestamps are ISO 8601 UTC text, JSON is text, booleans are 0/1.

import type { ColumnType, Generated, Insertable, Kysely, Selectable, Updateable } from "kysely";

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
  /** SHA-256 of the name_claim_token the template was first built with; later builds must present it. */
  name_claim_hash?: string | null;
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
  /** ArtifactConfig JSON (image config, layer digests, start/ready commands); null for the base template. */
  config_json?: string | null;
  /** The build input digest the final-artifact cache matches on. */
  source_digest?: string | null;
  /** Set when no tag points at the artifact any more; the collector removes it after this time. */
  retention_expires_at?: string | null;
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
  /** The host (data dir) whose runtime runs the machine; only that server reconciles, expires and adopts it. */
  host_id: string | null;
  /** While hibernated: `freeze` (processes frozen in memory), `disk` (stopped, disk kept) or `memory` (saved to disk). */
  hibernate_mode?: string | null;
  /** What its timeout does: `destroy` (default) or `hibernate`. */
  on_timeout?: Generated<string>;
  /** 1: a hibernated machine wakes on the next exec, files, WebSocket, port or edge request. */
  auto_resume?: Generated<number>;
  /** The snapshot the machine was made from (snp_…), or null. */
  snapshot_id?: string | null;
}

export interface SnapshotsTable {
  id: string; // snp_…
  machine_id: string;
  template_id: string;
  artifact_id: string;
  name: string | null;
  /** 1: the machine's processes were saved too (a runtime checkpoint beside the disk). */
  memory: number;
  status: string; // SNAPSHOT_STATUSES
  /** Bytes the snapshot holds on its host (disk image blocks, checkpoint); shared reflinked blocks count in full. */
  size_bytes: number;
  /** The machine's shape a snapshot restores into: its disk size, network, and (memory) runtime and guest runtime. */
  disk_mb: number;
  internet: number;
  network_json: string | null;
  vcpus: number;
  memory_mb: number;
  cwd: string | null;
  user: string;
  runtime: string;
  guest_runtime: string;
  /** Where its files are on its host: the disk image and (memory) the checkpoint dir. */
  disk_path: string | null;
  memory_path: string | null;
  metadata_json: string;
  /** Fork's own snapshots are internal: never listed, removed once the fork's machines exist. */
  internal: number;
  host_id: string;
  created_at: string;
  updated_at: string;
  deleted_at: string | null;
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

export interface BuildsTable {
  id: string; // bld_…
  template_id: string;
  name: string;
  tags_json: string;
  status: string; // BUILD_STATUSES
  build_backend: string;
  source_type: string;
  source_digest: string | null;
  context_digest: string | null;
  dockerfile_digest: string | null;
  triggered_by: string | null;
  queued_at: string;
  started_at: string | null;
  finished_at: string | null;
  duration_ms: number | null;
  failure_phase: string | null;
  failure_reason: string | null;
  cache_summary_json: string;
  artifact_ids_json: string;
  retention_expires_at: string | null;
  created_at: string;
  updated_at: string;
  /** The host whose server runs the build (null: made before hosts were named). */
  host_id: ColumnType<string | null, string | null | undefined, string | null>;
}

export interface BuildLogsTable {
  build_id: string;
  seq: number;
  kind: string;
  /** One SPEC.md build log entry, JSON. */
  entry_json: string;
}

export interface BuildCacheTable {
  /** sha256 of the parent layer's key, the step's Dockerfile text and its inputs' digests. */
  key: string;
  /** The step's layer directory; null for steps that change no file (env, user). */
  layer_dir: string | null;
  created_at: string;
  last_used_at: string;
}

export interface WebhooksTable {
  id: string; // whk_…
  url: string;
  operations_json: string; // JSON array of lifecycle operations
  enabled: number;
  /** The one place a signing secret is stored (it signs deliveries); never in a response, log or event. */
  signing_secret: string;
  /** The secret before the last rotation, still signing beside the new one until previous_secret_expires_at. */
  previous_signing_secret: string | null;
  previous_secret_expires_at: string | null;
  /** 1 when the operator's key let this webhook reach private and loopback receivers (never link-local). */
  allow_private: number;
  created_at: string;
  updated_at: string;
}

export interface WebhookDeliveriesTable {
  id: string; // dlv_…
  webhook_id: string;
  event_id: string;
  operation: string;
  /** The exact request body sent on every attempt (the signature covers it). */
  body: string;
  status: string; // queued | in_progress | succeeded | dead_letter
  /** Attempts made so far, interrupted ones included. */
  attempts: number;
  /** attempts at the last manual retry: the schedule restarts from there. */
  schedule_base: number;
  next_attempt_at: string;
  /** Host id of the server sending it now (in_progress), and until when that claim holds. */
  claimed_by: string | null;
  claimed_at: string | null;
  claim_expires_at: string | null;
  last_status_code: number | null;
  last_error: string | null;
  created_at: string;
  updated_at: string;
  completed_at: string | null;
}

export interface WebhookDeliveryAttemptsTable {
  delivery_id: string;
  attempt: number;
  started_at: string;
  duration_ms: number;
  status_code: number | null;
  error: string | null;
  response_excerpt: string | null;
}

export interface VolumesTable {
  id: string; // vol_…
  name: string;
  size_mb: number;
  status: string; // creating | ready | deleting
  created_at: string;
  updated_at: string;
  /** The host whose data dir holds it (null: made before hosts were recorded). */
  host_id: ColumnType<string | null, string | null | undefined, string | null>;
}

/** One row per volume a machine mounts; kept after the machine is gone (its status says whether it is live). */
export interface MachineVolumesTable {
  machine_id: string;
  volume_id: string;
  path: string;
  read_only: number;
  created_at: string;
}

export interface DeploymentsTable {
  id: string; // dep_…
  name: string;
  current_version_id: string;
  replicas: number;
  /** 1 when ready services get an edge URL. */
  public_url: number;
  /** token | public | signed: how its public URLs are authorised (src/deployments/edge.ts). */
  access: string;
  /** Random salt of the `token` access token (the token is an HMAC of it under the edge secret; never stored). */
  edge_salt: string;
  status: string; // active | deleting | deleted
  /** idle | rolling | failed — the rollout onto current_version_id. */
  rollout_status: string;
  rollout_error: string | null;
  /** The host whose server runs the rollout (src/deployments/rollout.ts); null: made before hosts ran rollouts. */
  rollout_host_id: string | null;
  created_at: string;
  updated_at: string;
  deleted_at: string | null;
}

export interface DeploymentVersionsTable {
  id: string; // ver_…
  deployment_id: string;
  number: number;
  template: string;
  command: string;
  port: number;
  /** The deployment's envs sealed with the data dir's key (src/deployments/sealed-envs.ts); restart envs are never here. */
  envs_sealed: string;
  /** Their names, JSON array: what the API shows. */
  env_names_json: string;
  /** {path?, interval_s, timeout_s} */
  readiness_json: string;
  created_at: string;
}

export interface ServicesTable {
  id: string; // svc_…
  deployment_id: string;
  version_id: string;
  status: string; // starting | ready | unhealthy | stopping | stopped | failed
  port: number;
  machine_id: string;
  process_id: number | null;
  /** Open JSON object: probe detail, crashes, the last restart. */
  readiness_json: string;
  failure_reason: string | null;
  started_at: string | null;
  stopped_at: string | null;
  idempotency_key: string | null;
  created_at: string;
  updated_at: string;
}

export interface ServiceRestartsTable {
  service_id: string;
  idempotency_key: string;
  /** The service record the first restart answered (never with public_url or envs). */
  result_json: string;
  created_at: string;
}

/** One Kiln server's host on a shared store (room: hosts). */
export interface HostsTable {
  id: string;
  name: string;
  advertise_url: string;
  /** active | draining | lost */
  status: string;
  capacity_json: string;
  heartbeat_at: string;
  started_at: string;
  created_at: string;
  updated_at: string;
  lost_at: string | null;
}

/** The cluster's shared secrets by name (one: `forward`, the key of host-to-host HMACs). */
export interface ClusterSecretsTable {
  name: string;
  secret: string;
  created_at: string;
}

/** A host that holds a layer (room: hosts): its content digest, where it is in that host's data dir, its tar's size. */
export interface LayerHoldersTable {
  digest: string;
  host_id: string;
  dir: string;
  bytes: number;
  created_at: string;
}

/**
 * A template build E2B's SDK requested (POST /v3/templates) and has not started yet (room: e2b): the host that will
 * build it (its uploads go there), and what the request said. Forgotten at `expires_at`.
 */
export interface E2bBuildRequestsTable {
  /** The build id the request reserved. */
  id: string;
  template_id: string;
  host_id: string;
  name: string;
  tags_json: string;
  vm_json: string;
  key_id: string | null;
  expires_at: string;
  created_at: string;
}

export interface Database {
  api_keys: ApiKeysTable;
  templates: TemplatesTable;
  template_aliases: TemplateAliasesTable;
  artifacts: ArtifactsTable;
  artifact_tags: ArtifactTagsTable;
  machines: MachinesTable;
  events: EventsTable;
  builds: BuildsTable;
  build_logs: BuildLogsTable;
  build_cache: BuildCacheTable;
  webhooks: WebhooksTable;
  webhook_deliveries: WebhookDeliveriesTable;
  webhook_delivery_attempts: WebhookDeliveryAttemptsTable;
  volumes: VolumesTable;
  machine_volumes: MachineVolumesTable;
  deployments: DeploymentsTable;
  deployment_versions: DeploymentVersionsTable;
  services: ServicesTable;
  service_restarts: ServiceRestartsTable;
  snapshots: SnapshotsTable;
  hosts: HostsTable;
  cluster_secrets: ClusterSecretsTable;
  layer_holders: LayerHoldersTable;
  e2b_build_requests: E2bBuildRequestsTable;
}

export type Db = Kysely<Database>;
export type MachineRow = Selectable<MachinesTable>;
export type NewMachine = Insertable<MachinesTable>;
export type MachineUpdate = Updateable<MachinesTable>;
export type ApiKeyRow = Selectable<ApiKeysTable>;
export type TemplateRow = Selectable<TemplatesTable>;
export type ArtifactRow = Selectable<ArtifactsTable>;
export type BuildRow = Selectable<BuildsTable>;
export type EventRow = Selectable<EventsTable>;
export type WebhookRow = Selectable<WebhooksTable>;
export type DeliveryRow = Selectable<WebhookDeliveriesTable>;
export type DeliveryAttemptRow = Selectable<WebhookDeliveryAttemptsTable>;
export type VolumeRow = Selectable<VolumesTable>;
export type DeploymentRow = Selectable<DeploymentsTable>;
export type DeploymentVersionRow = Selectable<DeploymentVersionsTable>;
export type ServiceRow = Selectable<ServicesTable>;
export type ServiceUpdate = Updateable<ServicesTable>;
export type SnapshotRow = Selectable<SnapshotsTable>;
export type SnapshotUpdate = Updateable<SnapshotsTable>;
export type HostRow = Selectable<HostsTable>;
