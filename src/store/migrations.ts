// The store's schema history, one ordered set of migrations for both dialects, run at every start.
// Portable column types everywhere; the only dialect branch is the auto-increment key of events.seq.

import { Migrator, sql } from "kysely";
import type { Kysely, Migration, MigrationProvider } from "kysely";

type Dialect = "sqlite" | "postgres";

function migrations(dialect: Dialect): Record<string, Migration> {
  return {
    "0001_initial": {
      async up(db: Kysely<any>) {
        await db.schema
          .createTable("api_keys")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("name", "text", (c) => c.notNull())
          .addColumn("prefix", "text", (c) => c.notNull())
          .addColumn("hash", "text", (c) => c.notNull().unique())
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("last_used_at", "text")
          .addColumn("revoked_at", "text")
          .execute();
        await db.schema
          .createTable("templates")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("namespace", "text", (c) => c.notNull())
          .addColumn("name", "text", (c) => c.notNull())
          .addColumn("canonical_ref", "text", (c) => c.notNull().unique())
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("updated_at", "text", (c) => c.notNull())
          .execute();
        await db.schema
          .createTable("template_aliases")
          .addColumn("alias_ref", "text", (c) => c.primaryKey())
          .addColumn("template_id", "text", (c) => c.notNull().references("templates.id"))
          .addColumn("created_at", "text", (c) => c.notNull())
          .execute();
        await db.schema
          .createTable("artifacts")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("template_id", "text", (c) => c.notNull().references("templates.id"))
          .addColumn("build_id", "text")
          .addColumn("layers_json", "text", (c) => c.notNull())
          .addColumn("digest", "text", (c) => c.notNull())
          .addColumn("created_at", "text", (c) => c.notNull())
          .execute();
        await db.schema
          .createTable("artifact_tags")
          .addColumn("template_id", "text", (c) => c.notNull().references("templates.id"))
          .addColumn("tag", "text", (c) => c.notNull())
          .addColumn("artifact_id", "text", (c) => c.notNull().references("artifacts.id"))
          .addColumn("updated_at", "text", (c) => c.notNull())
          .addPrimaryKeyConstraint("artifact_tags_pk", ["template_id", "tag"])
          .execute();
        await db.schema
          .createTable("machines")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("template_id", "text", (c) => c.notNull())
          .addColumn("artifact_id", "text", (c) => c.notNull())
          .addColumn("name", "text")
          .addColumn("status", "text", (c) => c.notNull())
          .addColumn("cwd", "text")
          .addColumn("user", "text", (c) => c.notNull())
          .addColumn("metadata_json", "text", (c) => c.notNull())
          .addColumn("vcpus", "integer", (c) => c.notNull())
          .addColumn("memory_mb", "integer", (c) => c.notNull())
          .addColumn("internet", "integer", (c) => c.notNull())
          .addColumn("timeout_s", "integer", (c) => c.notNull())
          .addColumn("expires_at", "text", (c) => c.notNull())
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("updated_at", "text", (c) => c.notNull())
          .addColumn("destroyed_at", "text")
          .addColumn("failure_reason", "text")
          .execute();
        await db.schema.createIndex("machines_status_expires").on("machines").columns(["status", "expires_at"]).execute();
        await db.schema.createIndex("machines_created").on("machines").columns(["created_at", "id"]).execute();
        await db.schema
          .createTable("events")
          .addColumn("seq", dialect === "postgres" ? "bigserial" : "integer", (c) => (dialect === "postgres" ? c.primaryKey() : c.primaryKey().autoIncrement()))
          .addColumn("id", "text", (c) => c.notNull().unique())
          .addColumn("operation", "text", (c) => c.notNull())
          .addColumn("machine_id", "text", (c) => c.notNull())
          .addColumn("payload_json", "text", (c) => c.notNull())
          .addColumn("occurred_at", "text", (c) => c.notNull())
          .execute();
        await db.schema.createIndex("events_machine").on("events").columns(["machine_id", "seq"]).execute();
      },
    },
    // A template's artifacts and aliases are listed by template, and PostgreSQL does not index foreign keys itself.
    "0002_template_children": {
      async up(db: Kysely<any>) {
        await db.schema.createIndex("artifacts_template").on("artifacts").columns(["template_id", "created_at"]).execute();
        await db.schema.createIndex("template_aliases_template").on("template_aliases").column("template_id").execute();
      },
    },
    // Template builds: build records, their durable logs, the layer cache, and what artifacts now carry (image
    // config, the source digest the final-artifact cache matches on, retention) and templates (name claims).
    "0005_builds": {
      async up(db: Kysely<any>) {
        await db.schema
          .createTable("builds")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("template_id", "text", (c) => c.notNull().references("templates.id"))
          .addColumn("name", "text", (c) => c.notNull())
          .addColumn("tags_json", "text", (c) => c.notNull())
          .addColumn("status", "text", (c) => c.notNull())
          .addColumn("build_backend", "text", (c) => c.notNull())
          .addColumn("source_type", "text", (c) => c.notNull())
          .addColumn("source_digest", "text")
          .addColumn("context_digest", "text")
          .addColumn("dockerfile_digest", "text")
          .addColumn("triggered_by", "text")
          .addColumn("queued_at", "text", (c) => c.notNull())
          .addColumn("started_at", "text")
          .addColumn("finished_at", "text")
          .addColumn("duration_ms", "bigint")
          .addColumn("failure_phase", "text")
          .addColumn("failure_reason", "text")
          .addColumn("cache_summary_json", "text", (c) => c.notNull())
          .addColumn("artifact_ids_json", "text", (c) => c.notNull())
          .addColumn("retention_expires_at", "text")
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("updated_at", "text", (c) => c.notNull())
          .execute();
        await db.schema.createIndex("builds_template_created").on("builds").columns(["template_id", "created_at", "id"]).execute();
        await db.schema.createIndex("builds_status").on("builds").column("status").execute();
        await db.schema
          .createTable("build_logs")
          .addColumn("build_id", "text", (c) => c.notNull())
          .addColumn("seq", "integer", (c) => c.notNull())
          .addColumn("kind", "text", (c) => c.notNull())
          .addColumn("entry_json", "text", (c) => c.notNull())
          .addPrimaryKeyConstraint("build_logs_pk", ["build_id", "seq"])
          .execute();
        await db.schema
          .createTable("build_cache")
          .addColumn("key", "text", (c) => c.primaryKey())
          .addColumn("layer_dir", "text")
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("last_used_at", "text", (c) => c.notNull())
          .execute();
        await db.schema.alterTable("artifacts").addColumn("config_json", "text").execute();
        await db.schema.alterTable("artifacts").addColumn("source_digest", "text").execute();
        await db.schema.alterTable("artifacts").addColumn("retention_expires_at", "text").execute();
        await db.schema.createIndex("artifacts_source_digest").on("artifacts").column("source_digest").execute();
        await db.schema.alterTable("templates").addColumn("name_claim_hash", "text").execute();
      },
    },
    // Lifecycle webhooks: registrations, a durable outbox of deliveries written with each event, and every attempt.
    // Machines name the host (data dir) that runs them, so several servers on one store reconcile only their own.
    "0004_webhooks": {
      async up(db: Kysely<any>) {
        await db.schema.alterTable("machines").addColumn("host_id", "text").execute();
        await db.schema.createIndex("machines_host_status").on("machines").columns(["host_id", "status"]).execute();
        await db.schema
          .createTable("webhooks")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("url", "text", (c) => c.notNull())
          .addColumn("operations_json", "text", (c) => c.notNull())
          .addColumn("enabled", "integer", (c) => c.notNull())
          .addColumn("signing_secret", "text", (c) => c.notNull())
          .addColumn("previous_signing_secret", "text")
          .addColumn("previous_secret_expires_at", "text")
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("updated_at", "text", (c) => c.notNull())
          .execute();
        await db.schema.createIndex("webhooks_created").on("webhooks").columns(["created_at", "id"]).execute();
        await db.schema
          .createTable("webhook_deliveries")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("webhook_id", "text", (c) => c.notNull())
          .addColumn("event_id", "text", (c) => c.notNull())
          .addColumn("operation", "text", (c) => c.notNull())
          .addColumn("body", "text", (c) => c.notNull())
          .addColumn("status", "text", (c) => c.notNull())
          .addColumn("attempts", "integer", (c) => c.notNull())
          .addColumn("schedule_base", "integer", (c) => c.notNull())
          .addColumn("next_attempt_at", "text", (c) => c.notNull())
          .addColumn("claimed_by", "text")
          .addColumn("claimed_at", "text")
          .addColumn("claim_expires_at", "text")
          .addColumn("last_status_code", "integer")
          .addColumn("last_error", "text")
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("updated_at", "text", (c) => c.notNull())
          .addColumn("completed_at", "text")
          .execute();
        // Covers the dispatcher's claim (due order, and which webhook) without reading the rows' bodies.
        await db.schema.createIndex("webhook_deliveries_due").on("webhook_deliveries").columns(["status", "next_attempt_at", "id", "webhook_id"]).execute();
        await db.schema.createIndex("webhook_deliveries_webhook").on("webhook_deliveries").columns(["webhook_id", "created_at", "id"]).execute();
        await db.schema
          .createTable("webhook_delivery_attempts")
          .addColumn("delivery_id", "text", (c) => c.notNull())
          .addColumn("attempt", "integer", (c) => c.notNull())
          .addColumn("started_at", "text", (c) => c.notNull())
          .addColumn("duration_ms", "integer", (c) => c.notNull())
          .addColumn("status_code", "integer")
          .addColumn("error", "text")
          .addColumn("response_excerpt", "text")
          .addPrimaryKeyConstraint("webhook_delivery_attempts_pk", ["delivery_id", "attempt"])
          .execute();
      },
    },
    // Volumes, and which machines mount which volume (so a volume a live machine mounts is never deleted).
    "0006_volumes": {
      async up(db: Kysely<any>) {
        await db.schema
          .createTable("volumes")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("name", "text", (c) => c.notNull())
          .addColumn("size_mb", "integer", (c) => c.notNull())
          .addColumn("status", "text", (c) => c.notNull())
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("updated_at", "text", (c) => c.notNull())
          .execute();
        await db.schema.createIndex("volumes_created").on("volumes").columns(["created_at", "id"]).execute();
        await db.schema
          .createTable("machine_volumes")
          .addColumn("machine_id", "text", (c) => c.notNull())
          .addColumn("volume_id", "text", (c) => c.notNull())
          .addColumn("path", "text", (c) => c.notNull())
          .addColumn("read_only", "integer", (c) => c.notNull())
          .addColumn("created_at", "text", (c) => c.notNull())
          .addPrimaryKeyConstraint("machine_volumes_pk", ["machine_id", "path"])
          .execute();
        await db.schema.createIndex("machine_volumes_volume").on("machine_volumes").column("volume_id").execute();
      },
    },
    // Agent deployments: a deployment, its versions, the service instances (replicas) and restart idempotency keys.
    "0007_deployments": {
      async up(db: Kysely<any>) {
        await db.schema
          .createTable("deployments")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("name", "text", (c) => c.notNull())
          .addColumn("current_version_id", "text", (c) => c.notNull())
          .addColumn("replicas", "integer", (c) => c.notNull())
          .addColumn("public_url", "integer", (c) => c.notNull())
          .addColumn("status", "text", (c) => c.notNull())
          .addColumn("rollout_status", "text", (c) => c.notNull())
          .addColumn("rollout_error", "text")
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("updated_at", "text", (c) => c.notNull())
          .addColumn("deleted_at", "text")
          .execute();
        await db.schema.createIndex("deployments_created").on("deployments").columns(["created_at", "id"]).execute();
        await db.schema
          .createTable("deployment_versions")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("deployment_id", "text", (c) => c.notNull().references("deployments.id"))
          .addColumn("number", "integer", (c) => c.notNull())
          .addColumn("template", "text", (c) => c.notNull())
          .addColumn("command", "text", (c) => c.notNull())
          .addColumn("port", "integer", (c) => c.notNull())
          .addColumn("envs_sealed", "text", (c) => c.notNull())
          .addColumn("env_names_json", "text", (c) => c.notNull())
          .addColumn("readiness_json", "text", (c) => c.notNull())
          .addColumn("created_at", "text", (c) => c.notNull())
          .addUniqueConstraint("deployment_versions_number", ["deployment_id", "number"])
          .execute();
        await db.schema
          .createTable("services")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("deployment_id", "text", (c) => c.notNull().references("deployments.id"))
          .addColumn("version_id", "text", (c) => c.notNull())
          .addColumn("status", "text", (c) => c.notNull())
          .addColumn("port", "integer", (c) => c.notNull())
          .addColumn("machine_id", "text", (c) => c.notNull())
          .addColumn("process_id", "integer")
          .addColumn("readiness_json", "text", (c) => c.notNull())
          .addColumn("failure_reason", "text")
          .addColumn("started_at", "text")
          .addColumn("stopped_at", "text")
          .addColumn("idempotency_key", "text")
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("updated_at", "text", (c) => c.notNull())
          .execute();
        await db.schema.createIndex("services_deployment").on("services").columns(["deployment_id", "created_at"]).execute();
        await db.schema.createIndex("services_status").on("services").column("status").execute();
        await db.schema
          .createTable("service_restarts")
          .addColumn("service_id", "text", (c) => c.notNull().references("services.id"))
          .addColumn("idempotency_key", "text", (c) => c.notNull())
          .addColumn("result_json", "text", (c) => c.notNull())
          .addColumn("created_at", "text", (c) => c.notNull())
          .addPrimaryKeyConstraint("service_restarts_pk", ["service_id", "idempotency_key"])
          .execute();
      },
    },
    // A machine's writable-layer size and its egress policy (allow_out/deny_out CIDRs as JSON; null: the default).
    "0003_machine_limits": {
      async up(db: Kysely<any>) {
        await db.schema.alterTable("machines").addColumn("disk_mb", "integer", (c) => c.notNull().defaultTo(10240)).execute();
        await db.schema.alterTable("machines").addColumn("network_json", "text").execute();
      },
    },
    // Snapshots of machines (room: snapshots) and the machine fields of hibernation modes and lifecycle.
    "0020_snapshots": {
      async up(db: Kysely<any>) {
        await db.schema
          .createTable("snapshots")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("machine_id", "text", (c) => c.notNull())
          .addColumn("template_id", "text", (c) => c.notNull())
          .addColumn("artifact_id", "text", (c) => c.notNull())
          .addColumn("name", "text")
          .addColumn("memory", "integer", (c) => c.notNull())
          .addColumn("status", "text", (c) => c.notNull())
          .addColumn("size_bytes", "bigint", (c) => c.notNull())
          .addColumn("disk_mb", "integer", (c) => c.notNull())
          .addColumn("internet", "integer", (c) => c.notNull())
          .addColumn("network_json", "text")
          .addColumn("vcpus", "integer", (c) => c.notNull())
          .addColumn("memory_mb", "integer", (c) => c.notNull())
          .addColumn("cwd", "text")
          .addColumn("user", "text", (c) => c.notNull())
          .addColumn("runtime", "text", (c) => c.notNull())
          .addColumn("guest_runtime", "text", (c) => c.notNull())
          .addColumn("disk_path", "text")
          .addColumn("memory_path", "text")
          .addColumn("metadata_json", "text", (c) => c.notNull())
          .addColumn("internal", "integer", (c) => c.notNull())
          .addColumn("host_id", "text", (c) => c.notNull())
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("updated_at", "text", (c) => c.notNull())
          .addColumn("deleted_at", "text")
          .addColumn("failure_reason", "text")
          .execute();
        await db.schema.createIndex("snapshots_created").on("snapshots").columns(["created_at", "id"]).execute();
        await db.schema.createIndex("snapshots_machine").on("snapshots").columns(["machine_id", "created_at"]).execute();
        await db.schema.createIndex("snapshots_host_status").on("snapshots").columns(["host_id", "status"]).execute();
        await db.schema.alterTable("machines").addColumn("hibernate_mode", "text").execute();
        await db.schema.alterTable("machines").addColumn("on_timeout", "text", (c) => c.notNull().defaultTo("destroy")).execute();
        await db.schema.alterTable("machines").addColumn("auto_resume", "integer", (c) => c.notNull().defaultTo(0)).execute();
        await db.schema.alterTable("machines").addColumn("snapshot_id", "text").execute();
      },
    },
    // How a deployment's public URLs are authorised: a long-lived rotatable token (the default), public, or signed.
    // Deployments made before keep the signed URLs they had (no long-lived credential appears by surprise);
    // PATCH access: "token" moves them over.
    "0024_edge_access": {
      async up(db: Kysely<any>) {
        await db.schema.alterTable("deployments").addColumn("access", "text", (c) => c.notNull().defaultTo("signed")).execute();
        await db.schema.alterTable("deployments").addColumn("edge_salt", "text", (c) => c.notNull().defaultTo("")).execute();
      },
    },
    // A webhook the operator's key lets reach private and loopback receivers, without a server-wide setting or restart.
    "0024_webhook_allow_private": {
      async up(db: Kysely<any>) {
        await db.schema.alterTable("webhooks").addColumn("allow_private", "integer", (c) => c.notNull().defaultTo(0)).execute();
      },
    },
    // Hosts of servers sharing one store, and the cluster secret that authenticates their calls to each other.
    "0021_hosts": {
      async up(db: Kysely<any>) {
        await db.schema
          .createTable("hosts")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("name", "text", (c) => c.notNull())
          .addColumn("advertise_url", "text", (c) => c.notNull())
          .addColumn("status", "text", (c) => c.notNull())
          .addColumn("capacity_json", "text", (c) => c.notNull())
          .addColumn("heartbeat_at", "text", (c) => c.notNull())
          .addColumn("started_at", "text", (c) => c.notNull())
          .addColumn("created_at", "text", (c) => c.notNull())
          .addColumn("updated_at", "text", (c) => c.notNull())
          .addColumn("lost_at", "text")
          .execute();
        await db.schema
          .createTable("cluster_secrets")
          .addColumn("name", "text", (c) => c.primaryKey())
          .addColumn("secret", "text", (c) => c.notNull())
          .addColumn("created_at", "text", (c) => c.notNull())
          .execute();
        // A build belongs to the host running it: another server's start or a lost host's sweep ends only its own.
        await db.schema.alterTable("builds").addColumn("host_id", "text").execute();
      },
    },
    // The outbox's history is pruned by age: finished deliveries by when they finished, events by when they occurred.
    "0026_webhook_history": {
      async up(db: Kysely<any>) {
        await db.schema.createIndex("webhook_deliveries_completed").on("webhook_deliveries").columns(["completed_at"]).execute();
        await db.schema.createIndex("events_occurred").on("events").columns(["occurred_at"]).execute();
      },
    },
    // Which hosts hold which layers, by content digest (the sha256 of the layer's packed tar, src/hosts/layers/):
    // a host lacking a template's layers fetches them from a holder; placement prefers holders; retention forgets.
    "0028_layer_holders": {
      async up(db: Kysely<any>) {
        await db.schema
          .createTable("layer_holders")
          .addColumn("digest", "text", (c) => c.notNull())
          .addColumn("host_id", "text", (c) => c.notNull())
          .addColumn("dir", "text", (c) => c.notNull())
          .addColumn("bytes", "bigint", (c) => c.notNull())
          .addColumn("created_at", "text", (c) => c.notNull())
          .addPrimaryKeyConstraint("layer_holders_pk", ["digest", "host_id"])
          .execute();
        await db.schema.createIndex("layer_holders_dir").on("layer_holders").columns(["host_id", "dir"]).execute();
      },
    },
    // A volume's data lives on one host: its file routes and WebSocket are served there, machines mounting it are
    // placed there, and each server mounts only its own at start. Null: made before hosts (the host that has it).
    "0027_volume_hosts": {
      async up(db: Kysely<any>) {
        await db.schema.alterTable("volumes").addColumn("host_id", "text").execute();
      },
    },
    // E2B template builds requested and not started, in the store rather than one server's memory: any server finds
    // the host a requested build's uploads, start and status go to (docs/e2b.md, docs/hosts.md).
    "0029_e2b_build_requests": {
      async up(db: Kysely<any>) {
        await db.schema
          .createTable("e2b_build_requests")
          .addColumn("id", "text", (c) => c.primaryKey())
          .addColumn("template_id", "text", (c) => c.notNull())
          .addColumn("host_id", "text", (c) => c.notNull())
          .addColumn("name", "text", (c) => c.notNull())
          .addColumn("tags_json", "text", (c) => c.notNull())
          .addColumn("vm_json", "text", (c) => c.notNull())
          .addColumn("key_id", "text")
          .addColumn("expires_at", "text", (c) => c.notNull())
          .addColumn("created_at", "text", (c) => c.notNull())
          .execute();
        await db.schema.createIndex("e2b_build_requests_template").on("e2b_build_requests").columns(["template_id", "expires_at"]).execute();
        await db.schema.createIndex("e2b_build_requests_expires").on("e2b_build_requests").columns(["expires_at"]).execute();
      },
    },
    // The host whose server runs a deployment's rollout while it is rolling: that server resumes it after a restart
    // (wherever the replicas run), a survivor takes it over when that host is lost, and a rollout that another
    // server took over (a PATCH there, a lost host's replacements) stops at its next step. Null: made before this.
    "0030_deployment_rollout_host": {
      async up(db: Kysely<any>) {
        await db.schema.alterTable("deployments").addColumn("rollout_host_id", "text").execute();
      },
    },
  };
}

export async function migrate(db: Kysely<any>, dialect: Dialect): Promise<void> {
  const provider: MigrationProvider = { getMigrations: async () => migrations(dialect) };
  // Rooms are numbered by when they were planned, not when they landed: a store that already ran a later-numbered
  // migration still takes an earlier-numbered one it lacks (each touches its own tables and columns).
  const { error, results } = await new Migrator({ db, provider, allowUnorderedMigrations: true }).migrateToLatest();
  if (error) {
    const failed = results?.find((r) => r.status === "Error")?.migrationName ?? "?";
    throw new Error(`store migration ${failed} failed: ${(error as Error).message}`, { cause: error });
  }
}

/** Used by tests to prove a second run is a no-op. */
export async function appliedMigrations(db: Kysely<any>): Promise<string[]> {
  const rows = await sql<{ name: string }>`select name from kysely_migration order by name`.execute(db);
  return rows.rows.map((r) => r.name);
}
