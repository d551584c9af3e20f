// Opens Kiln's store: SQLite in the data dir by default, PostgreSQL when KILN_DATABASE_URL says so; one set of
// Kysely queries and migrations serves both. Migrations run here, at every open.

import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { Kysely, PostgresDialect, sql } from "kysely";
import pg from "pg";
import type { Database, Db } from "./schema.ts";
import { openSqlite } from "./sqlite-dialect.ts";
import { migrate } from "./migrations.ts";
import type { Logger } from "../log.ts";

export interface Store {
  db: Db;
  dialect: "sqlite" | "postgres";
  ping(): Promise<void>;
  close(): Promise<void>;
}

export async function openStore(opts: { databaseUrl?: string; dataDir: string; log?: Logger }): Promise<Store> {
  const url = opts.databaseUrl;
  let db: Db;
  let dialect: Store["dialect"];
  if (!url) {
    mkdirSync(opts.dataDir, { recursive: true });
    db = new Kysely<Database>({ dialect: openSqlite(join(opts.dataDir, "kiln.db")).dialect });
    dialect = "sqlite";
  } else if (/^postgres(ql)?:\/\//.test(url)) {
    // int8 (bigserial) as a JS number: event sequence numbers stay far below 2^53.
    pg.types.setTypeParser(20, (v: string) => Number(v));
    db = new Kysely<Database>({ dialect: new PostgresDialect({ pool: new pg.Pool({ connectionString: url, max: 10 }) }) });
    dialect = "postgres";
  } else {
    const scheme = url.split(":")[0];
    throw new Error(`Unsupported database URL scheme ${JSON.stringify(scheme)}: use postgres:// or leave it unset for SQLite`);
  }
  try {
    await migrate(db, dialect);
  } catch (err) {
    await db.destroy();
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
