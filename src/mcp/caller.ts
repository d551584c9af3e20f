// How MCP tools reach Kiln: through its own HTTP API with the caller's key, so the route's auth, validation, limits
// and errors apply exactly as for any client. In the server, an in-process inject; for `kiln mcp`, loopback HTTP.

import type { Readable } from "node:stream";
import { request } from "undici";
import type { App } from "../api/app-type.ts";
import { ERROR_CATALOGUE, KilnError } from "../errors.ts";
import type { ErrorCode } from "../errors.ts";

export interface KilnResponse {
  status: number;
  contentType: string;
  body: Buffer;
  /** The answer had more than `maxBytes` bytes: `body` holds the first `maxBytes`, the rest was not read. */
  truncated: boolean;
}

export interface KilnRequest {
  query?: Record<string, string | number | boolean | undefined>;
  /** Sent as application/json. */
  json?: unknown;
  /** Sent as application/octet-stream (file uploads). */
  bytes?: Buffer;
  /** Read at most this much of the answer (default DEFAULT_MAX_BYTES); nothing a machine controls is buffered unbounded. */
  maxBytes?: number;
}

/** The most of one answer a tool reads unless it asks for less: exec and code answers are bounded by their routes too. */
export const DEFAULT_MAX_BYTES = 64 * 1024 * 1024;

/** One call to Kiln's HTTP API as the MCP client's key holder. */
export type KilnCaller = (method: "GET" | "POST" | "PUT" | "DELETE", path: string, req?: KilnRequest) => Promise<KilnResponse>;

/**
 * Bytes of Kiln's answers that the MCP requests in flight on one server may hold at once. A tool's answer is held until
 * its POST is answered (in JSON response mode, every answer of a batch until the last is ready), and one run_code
 * answer may carry 32 MB of images: a batch of them held gigabytes (five: +700 MB of RSS; twenty never answered).
 * Past the budget a tool call answers 503 `unavailable` (retryable) instead of reading more.
 */
export const MCP_HELD_MAX_BYTES = 128 * 1024 * 1024;

/** The server's budget for held answers; each MCP request takes from it through its own ledger, given back when it ends. */
export function heldAnswersBudget(max = MCP_HELD_MAX_BYTES) {
  let held = 0;
  return {
    ledger() {
      let mine = 0;
      return {
        /** Takes `n` bytes, or false when the server holds too much already. */
        take(n: number): boolean {
          if (held + n > max) return false;
          held += n;
          mine += n;
          return true;
        },
        release() {
          held -= mine;
          mine = 0;
        },
      };
    },
    held: () => held,
  };
}

/** Longest a stdio call waits for Kiln's answer: past the longest bound a route itself keeps (exec and code, 3600 s). */
const STDIO_CALL_TIMEOUT_MS = 3_660_000;

function withQuery(path: string, query: KilnRequest["query"]): string {
  if (!query) return path;
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(query)) if (v !== undefined) q.set(k, String(v));
  const s = q.toString();
  return s ? `${path}?${s}` : path;
}

function bodyOf(req: KilnRequest): { payload?: string | Buffer; contentType?: string } {
  if (req.json !== undefined) return { payload: JSON.stringify(req.json), contentType: "application/json" };
  if (req.bytes !== undefined) return { payload: req.bytes, contentType: "application/octet-stream" };
  return {};
}

/**
 * Calls into the server that received the MCP request, with the key that request carried and its Host (so URLs the
 * API builds name the address the client used). Nothing leaves the process.
 */
export function injectCaller(app: App, auth: { key: string; host: string | undefined; take?: (bytes: number) => boolean }): KilnCaller {
  return async (method, path, req = {}) => {
    const { payload, contentType } = bodyOf(req);
    const res = await app.inject({
      method,
      url: withQuery(path, req.query),
      headers: { authorization: `Bearer ${auth.key}`, ...(auth.host ? { host: auth.host } : {}), ...(contentType ? { "content-type": contentType } : {}) },
      payload,
      payloadAsStream: true,
    });
    const { body, truncated } = await readBounded(res.stream(), req.maxBytes ?? DEFAULT_MAX_BYTES, auth.take);
    return { status: res.statusCode, contentType: String(res.headers["content-type"] ?? ""), body, truncated };
  };
}

/** Calls a Kiln server over HTTP (`kiln mcp`: KILN_URL with KILN_API_KEY). */
export function httpCaller(baseUrl: string, key: string): KilnCaller {
  const base = baseUrl.replace(/\/+$/, "");
  return async (method, path, req = {}) => {
    const { payload, contentType } = bodyOf(req);
    let res;
    try {
      res = await request(base + withQuery(path, req.query), {
        method,
        headers: { authorization: `Bearer ${key}`, ...(contentType ? { "content-type": contentType } : {}) },
        body: payload,
        headersTimeout: STDIO_CALL_TIMEOUT_MS,
        bodyTimeout: STDIO_CALL_TIMEOUT_MS,
      });
    } catch (err) {
      throw new KilnError("unavailable", `cannot reach Kiln at ${base}: ${(err as Error).message}`);
    }
    const { body, truncated } = await readBounded(res.body, req.maxBytes ?? DEFAULT_MAX_BYTES);
    return { status: res.statusCode, contentType: String(res.headers["content-type"] ?? ""), body, truncated };
  };
}

/** Reads a stream up to `max` bytes; past it the stream is destroyed (the request ends) instead of being buffered. */
async function readBounded(stream: Readable, max: number, take?: (bytes: number) => boolean): Promise<{ body: Buffer; truncated: boolean }> {
  const chunks: Buffer[] = [];
  let size = 0;
  let truncated = false;
  let refused = false;
  for await (const chunk of stream) {
    const b = Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk as string);
    // Over the budget the rest is read and dropped, not cut: a route cut mid-answer (an in-process inject) stalls on
    // its full buffer, and a code execute would then hold its kernel for every later call.
    if (refused || (take && !take(Math.min(b.length, max - size)))) {
      refused = true;
      continue;
    }
    if (size + b.length > max) {
      chunks.push(b.subarray(0, max - size));
      size = max;
      truncated = true;
      break;
    }
    chunks.push(b);
    size += b.length;
  }
  if (refused) throw new KilnError("unavailable", `The server holds ${MCP_HELD_MAX_BYTES / 1024 / 1024} MiB of MCP tool answers not yet sent; try again when fewer are in flight`, { detail: { retryable: true } });
  if (truncated) stream.destroy();
  return { body: Buffer.concat(chunks, size), truncated };
}

/** A Kiln error answer as the KilnError it stands for (code and message as the API gave them). */
export function errorOf(res: KilnResponse): KilnError {
  let envelope: { code?: unknown; error?: unknown; request_id?: unknown } = {};
  try {
    envelope = JSON.parse(res.body.toString("utf8")) as typeof envelope;
  } catch {
    // Not an envelope (a proxy in between): the status says what it can.
  }
  const code = typeof envelope.code === "string" && envelope.code in ERROR_CATALOGUE ? (envelope.code as ErrorCode) : res.status >= 500 ? "internal" : "invalid_request";
  const message = typeof envelope.error === "string" ? envelope.error : `Kiln answered HTTP ${res.status}`;
  const requestId = typeof envelope.request_id === "string" ? envelope.request_id : undefined;
  return new KilnError(code, message, requestId ? { detail: { request_id: requestId } } : {});
}

/** The JSON answer of a call, or its error thrown. */
export async function callJson<T>(call: KilnCaller, method: Parameters<KilnCaller>[0], path: string, req?: KilnRequest): Promise<T> {
  const res = await call(method, path, req);
  if (res.status >= 400) throw errorOf(res);
  if (res.status === 204 || res.body.length === 0) return undefined as T;
  return JSON.parse(res.body.toString("utf8")) as T;
}
