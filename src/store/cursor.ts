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

/**
 * A directory listing's cursor (files/list of machines and volumes): the path of the last entry given, bound to the
 * listing it came from (the directory and depth), so it cannot be replayed against another one.
 */
export function encodeListCursor(listing: { path: string; depth: number }, after: string[]): string {
  return Buffer.from(JSON.stringify({ v: "list-1", path: listing.path, depth: listing.depth, after })).toString("base64url");
}

/** The names to list after, from a cursor encodeListCursor made for this same listing; 400 otherwise. */
export function decodeListCursor(cursor: string, listing: { path: string; depth: number }): string[] {
  let parsed: { v?: unknown; path?: unknown; depth?: unknown; after?: unknown } = {};
  try {
    parsed = JSON.parse(Buffer.from(cursor, "base64url").toString("utf8"));
  } catch {
    // refused below
  }
  const after = parsed.after;
  const names = Array.isArray(after) && after.length > 0 && after.every((n) => typeof n === "string" && n.length > 0 && !n.includes("/") && !n.includes("\0") && n !== "." && n !== "..");
  if (parsed.v !== "list-1" || !names) throw new KilnError("invalid_request", "cursor is not a cursor this server issued");
  if (parsed.path !== listing.path || parsed.depth !== listing.depth) throw new KilnError("invalid_request", "cursor belongs to another listing (path and depth must stay the same across pages)");
  return after as string[];
}

/** The next_cursor of a keyset page: null on the last page. */
export function nextCursor(page: { last?: [string, string]; more: boolean }): string | null {
  return page.more && page.last ? encodeCursor(page.last) : null;
}
