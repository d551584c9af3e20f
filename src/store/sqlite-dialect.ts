// Kysely's SQLite dialect over Node's built-in node:sqlite (no native addon to build): an adapter that gives
// DatabaseSync the small better-sqlite3-shaped surface Kysely's SqliteDriver calls.

import { DatabaseSync } from "node:sqlite";
import type { StatementSync } from "node:sqlite";
import { SqliteDialect } from "kysely";
import type { SqliteDatabase, SqliteStatement } from "kysely";

type Params = readonly unknown[];

function adaptStatement(stmt: StatementSync): SqliteStatement {
  // Kysely asks whether a statement returns rows to choose between all() and run().
  const reader = stmt.columns().length > 0;
  return {
    reader,
    all: (params: Params) => stmt.all(...(params as never[])) as unknown[],
    run: (params: Params) => {
      const r = stmt.run(...(params as never[]));
      return { changes: r.changes, lastInsertRowid: r.lastInsertRowid };
    },
    iterate: (params: Params) => stmt.iterate(...(params as never[])) as IterableIterator<unknown>,
  };
}

export function openSqlite(file: string): SqliteDialect {
  const raw = new DatabaseSync(file);
  raw.exec("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 5000;");
  // Kysely prepares every query it runs; preparing is most of the cost of a small query, so keep them.
  const statements = new Map<string, SqliteStatement>();
  const adapter: SqliteDatabase = {
    prepare(sql: string) {
      let stmt = statements.get(sql);
      if (!stmt) {
        if (statements.size >= 500) statements.delete(statements.keys().next().value!);
        stmt = adaptStatement(raw.prepare(sql));
        statements.set(sql, stmt);
      }
      return stmt;
    },
    close: () => {
      statements.clear();
      raw.close();
    },
  };
  return new SqliteDialect({ database: adapter });
}
