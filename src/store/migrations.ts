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
    // A machine's writable-layer size and its egress policy (allow_out/deny_out CIDRs as JSON; null: the default).
    "0003_machine_limits": {
      async up(db: Kysely<any>) {
        await db.schema.alterTable("machines").addColumn("disk_mb", "integer", (c) => c.notNull().defaultTo(10240)).execute();
        await db.schema.alterTable("machines").addColumn("network_json", "text").execute();
      },
    },
  };
}

export async function migrate(db: Kysely<any>, dialect: Dialect): Promise<void> {
  const provider: MigrationProvider = { getMigrations: async () => migrations(dialect) };
  const { error, results } = await new Migrator({ db, provider }).migrateToLatest();
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
