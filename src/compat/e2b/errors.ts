// E2B's error body, `{code, message}` with the HTTP status as `code`: the SDK branches on it (404 unknown
// sandbox, 401 bad key, 409 already paused …). Kiln's catalogue status carries over; 500s say nothing more.

import { KilnError } from "../../errors.ts";

/** An E2B API Kiln does not serve: 501, which Kiln's own catalogue has no code for. */
export class E2bUnserved extends Error {}

export function e2bError(err: unknown): { status: number; body: { code: number; message: string } } {
  if (err instanceof E2bUnserved) return { status: 501, body: { code: 501, message: err.message } };
  if (err instanceof KilnError) {
    const status = err.status;
    return { status, body: { code: status, message: status >= 500 && err.code === "internal" ? "Internal error" : err.message } };
  }
  const e = err as { statusCode?: number; validation?: unknown; message?: string };
  // Fastify's own failures: a body that is not JSON, a body too large, an unknown content type.
  if (typeof e?.statusCode === "number" && e.statusCode >= 400 && e.statusCode < 500) return { status: e.statusCode, body: { code: e.statusCode, message: e.message ?? "Bad request" } };
  return { status: 500, body: { code: 500, message: "Internal error" } };
}
