// Kysely's SQLite dialect over Node's built-in node:sqlite (no native addon to build): an adapter that gives
// DatabaseSync the small better-sqlite3-shaped surface Kysely's SqliteDriver calls.

import { DatabaseSync } from "node:sqlite";
import type { StatementSync } from "node:sqlite";
import { SqliteDialect } from "kysely";
import type { SqliteDatabase, SqliteStatement } from "kysely";

type Params = readonly unknown[];

function adaptStatement(stmt: StatementSync): SqliteStatement {
  return {
    // Kysely asks whether a statement returns rows to choose between all() and run().
    get reader() {
      return stmt.columns().length > 0;
    },
    all: (params: Params) => stmt.all(...(params as never[])) as unknown[],
    run: (params: Params) => {
      const r = stmt.run(...(params as never[]));
      return { changes: r.changes, lastInsertRowid: r.lastInsertRowid };
    },
    iterate: (params: Params) => stmt.iterate(...(params as never[])) as IterableIterator<unknown>,
  };
}

export function openSqlite(file: string): { dialect: SqliteDialect; raw: DatabaseSync } {
  const raw = new DatabaseSync(file);
  raw.exec("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 5000;");
  const adapter: SqliteDatabase = {
    prepare: (sql: string) => adaptStatement(raw.prepare(sql)),
    close: () => raw.close(),
  };
  return { dialect: new SqliteDialect({ database: adapter }), raw };
}
