// Opaque pagination cursors: the sort key of the last row a page returned (for machines: created_at and id),
// wrapped so clients treat it as opaque. Keyset pages stay stable while rows are inserted between requests.

import { KilnError } from "../errors.ts";

export class InvalidCursorError extends Error {}

export function encodeCursor(key: string[]): string {
  return Buffer.from(JSON.stringify({ v: 2, after: key })).toString("base64url");
}

export function decodeCursor(cursor: string, parts: number): string[] {
  try {
    const parsed = JSON.parse(Buffer.from(cursor, "base64url").toString("utf8")) as { v?: unknown; after?: unknown };
    if (parsed.v === 2 && Array.isArray(parsed.after) && parsed.after.length === parts && parsed.after.every((p) => typeof p === "string" && p.length > 0 && p.length < 200)) {
      return parsed.after as string[];
    }
  } catch {
    // fall through
  }
  throw new InvalidCursorError("cursor is not a cursor this server issued");
}

/**
 * Where a newest-first page keyed on (created_at, id) starts: undefined for the first page; a cursor this server did
 * not issue is the caller's mistake (400).
 */
export function pageAfter(cursor: string | undefined): [string, string] | undefined {
  if (!cursor) return undefined;
  try {
    return decodeCursor(cursor, 2) as [string, string];
  } catch {
    throw new KilnError("invalid_request", "cursor is not a cursor this server issued");
  }
}
