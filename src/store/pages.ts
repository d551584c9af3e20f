// The one keyset-pagination query: newest first by (created_at, id), starting after the key of the previous page's
// last row, one row more than asked so the caller knows whether another page follows. Every list of records uses it.

import { sql } from "kysely";
import type { SelectQueryBuilder, SqlBool } from "kysely";

/** The sort key of a row in a newest-first list: its created_at and id (cursor.ts wraps it for clients). */
export type PageKey = [createdAt: string, id: string];

export interface KeysetPage<R> {
  rows: R[];
  /** The key of the page's last row, to start the next page after. */
  last: PageKey | undefined;
  more: boolean;
}

/** Runs `q` (already filtered) as one newest-first page of at most `limit` rows after `after`. */
export async function newestFirstPage<DB, TB extends keyof DB, R extends { created_at: string; id: string }>(
  q: SelectQueryBuilder<DB, TB, R>,
  o: { limit: number; after?: PageKey },
): Promise<KeysetPage<R>> {
  const createdAt = sql.ref("created_at");
  const id = sql.ref("id");
  let page = q.orderBy(createdAt, "desc").orderBy(id, "desc").limit(o.limit + 1);
  const after = o.after;
  if (after) page = page.where(sql<SqlBool>`(${createdAt} < ${after[0]} or (${createdAt} = ${after[0]} and ${id} < ${after[1]}))`);
  const rows = await page.execute();
  const shown = rows.slice(0, o.limit);
  const last = shown.at(-1);
  return { rows: shown, last: last ? [last.created_at, last.id] : undefined, more: rows.length > o.limit };
}
