// Opens Kiln's store: SQLite in the data dir by default, PostgreSQL when KILN_DATABASE_URL says so; one set of
// Kysely queries and migrations serves both. Migrations run here, at every open.

import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { Kysely, PostgresDialect, sql } from "kysely";
import type { Dialect } from "kysely";
import pg from "pg";
import type { Database, Db } from "./schema.ts";
import { openSqlite } from "./sqlite-dialect.ts";
import { migrate } from "./migrations.ts";
import type { Logger } from "../log.ts";

export interface Store {
  db: Db;
  dialect: "sqlite" | "postgres";
  /** Resolves when the database answers a trivial query (readiness). */
  ping(): Promise<void>;
  close(): Promise<void>;
}

const INT8_OID = 20;

// int8 (bigserial, count(*)) as a JS number, as SQLite gives it: event sequence numbers stay far below 2^53.
// Scoped to Kiln's pool rather than pg's global parser table.
const pgTypes = {
  getTypeParser: ((oid: number, format?: "text" | "binary") =>
    oid === INT8_OID && format !== "binary" ? (v: string) => Number(v) : pg.types.getTypeParser(oid, format as "text")) as typeof pg.types.getTypeParser,
};

/** The scheme of a URL-ish string, or null; never the rest of it (it may hold a password). */
function schemeOf(url: string): string | null {
  return /^([A-Za-z][A-Za-z0-9+.-]*):/.exec(url)?.[1] ?? null;
}

export async function openStore(opts: { databaseUrl?: string; dataDir: string; log?: Logger }): Promise<Store> {
  const url = opts.databaseUrl?.trim();
  let dialect: Store["dialect"];
  let driver: Dialect;
  if (!url) {
    const file = join(opts.dataDir, "kiln.db");
    try {
      mkdirSync(opts.dataDir, { recursive: true });
      driver = openSqlite(file);
    } catch (err) {
      throw new Error(`cannot open the SQLite store at ${file}: ${(err as Error).message}`, { cause: err });
    }
    dialect = "sqlite";
  } else {
    const scheme = schemeOf(url);
    if (scheme !== "postgres" && scheme !== "postgresql") {
      throw new Error(
        scheme
          ? `unsupported database URL scheme "${scheme}:": KILN_DATABASE_URL must be postgres:// or postgresql://, or unset for SQLite`
          : "KILN_DATABASE_URL is not a URL: it must be postgres:// or postgresql://, or unset for SQLite",
      );
    }
    const pool = new pg.Pool({ connectionString: url, max: 10, types: pgTypes });
    // An idle client that loses its server emits 'error' on the pool; unhandled, that would end the process.
    // The next query gets a fresh connection, or the error, so logging is enough here.
    pool.on("error", (err) => opts.log?.warn({ err: { message: err.message, code: (err as { code?: string }).code } }, "idle PostgreSQL connection failed"));
    driver = new PostgresDialect({ pool });
    dialect = "postgres";
  }
  const db = new Kysely<Database>({ dialect: driver });
  try {
    await migrate(db, dialect);
  } catch (err) {
    await db.destroy().catch(() => {});
    throw err;
  }
  opts.log?.debug({ dialect }, "store open");
  return {
    db,
    dialect,
    async ping() {
      await sql`select 1`.execute(db);
    },
    async close() {
      await db.destroy();
    },
  };
}
