// Opaque pagination cursors: the id of the last row a page returned, wrapped so clients treat it as opaque.
// Pages are `id < after ORDER BY id DESC`, which stays stable while rows are inserted between requests.

export class InvalidCursorError extends Error {}

export function encodeCursor(lastId: string): string {
  return Buffer.from(JSON.stringify({ v: 1, after: lastId })).toString("base64url");
}

export function decodeCursor(cursor: string): string {
  try {
    const parsed = JSON.parse(Buffer.from(cursor, "base64url").toString("utf8")) as { v?: unknown; after?: unknown };
    if (parsed.v === 1 && typeof parsed.after === "string" && /^[a-z]{3}_[0-9a-z]{26}$/.test(parsed.after)) return parsed.after;
  } catch {
    // fall through
  }
  throw new InvalidCursorError("cursor is not a cursor this server issued");
}
