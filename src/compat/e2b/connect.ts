// The Connect protocol in JSON, server side, as E2B's envd speaks it: unary calls (POST application/json) and
// server streams (application/connect+json envelopes: 1 flag byte, 4-byte big-endian length, JSON).

import { PassThrough } from "node:stream";
import type { FastifyReply } from "fastify";
import { KilnError } from "../../errors.ts";

export const CONNECT_CODES = {
  canceled: 499,
  unknown: 500,
  invalid_argument: 400,
  deadline_exceeded: 504,
  not_found: 404,
  already_exists: 409,
  permission_denied: 403,
  resource_exhausted: 429,
  failed_precondition: 400,
  aborted: 409,
  out_of_range: 400,
  unimplemented: 501,
  internal: 500,
  unavailable: 503,
  data_loss: 500,
  unauthenticated: 401,
} as const;
export type ConnectCode = keyof typeof CONNECT_CODES;

/** An error an RPC handler throws with the Connect code the SDK branches on (NotFound, AlreadyExists …). */
export class ConnectFailure extends Error {
  readonly code: ConnectCode;
  constructor(code: ConnectCode, message: string) {
    super(message);
    this.code = code;
  }
}

const FROM_KILN: Record<string, ConnectCode> = {
  invalid_request: "invalid_argument",
  unauthorized: "unauthenticated",
  forbidden: "permission_denied",
  not_found: "not_found",
  conflict: "failed_precondition",
  machine_not_running: "unavailable",
  payload_too_large: "resource_exhausted",
  rate_limited: "resource_exhausted",
  unavailable: "unavailable",
  timeout: "deadline_exceeded",
};

/** Any thrown value as a Connect error body; internal failures carry no detail. */
export function connectError(err: unknown): { code: ConnectCode; message: string } {
  if (err instanceof ConnectFailure) return { code: err.code, message: err.message };
  if (err instanceof KilnError) {
    const code = FROM_KILN[err.code] ?? "internal";
    return { code, message: code === "internal" ? "internal error" : err.message };
  }
  // Fastify's own refusals before a handler runs: a body that is not JSON, too large, of an unknown type.
  const status = (err as { statusCode?: unknown })?.statusCode;
  if (typeof status === "number" && status >= 400 && status < 500) {
    const code: ConnectCode = status === 413 ? "resource_exhausted" : status === 415 ? "unimplemented" : "invalid_argument";
    return { code, message: (err as Error).message };
  }
  return { code: "internal", message: "internal error" };
}

export function envelope(flags: number, message: unknown): Buffer {
  const json = Buffer.from(JSON.stringify(message));
  const head = Buffer.alloc(5);
  head.writeUInt8(flags, 0);
  head.writeUInt32BE(json.length, 1);
  return Buffer.concat([head, json]);
}

/** The one request message of a server-streaming call (the body is a single envelope). */
export function parseEnvelopedRequest(body: Buffer): unknown {
  if (body.length < 5) throw new ConnectFailure("invalid_argument", "the request is not a Connect envelope");
  const len = body.readUInt32BE(1);
  if (body.length < 5 + len) throw new ConnectFailure("invalid_argument", "the request envelope is truncated");
  if ((body.readUInt8(0) & 0x01) !== 0) throw new ConnectFailure("unimplemented", "compressed requests are not supported");
  return parseJson(body.subarray(5, 5 + len));
}

export function parseJson(buf: Buffer | string): unknown {
  try {
    const v = JSON.parse(buf.toString() || "{}");
    if (typeof v !== "object" || v === null || Array.isArray(v)) throw new Error();
    return v;
  } catch {
    throw new ConnectFailure("invalid_argument", "the request message is not a JSON object");
  }
}

export function sendUnaryError(reply: FastifyReply, err: unknown) {
  const body = connectError(err);
  return reply.code(CONNECT_CODES[body.code]).type("application/json").send(body);
}

export interface ServerStream {
  send(message: unknown): void;
  /** Ends the stream, with an error in the end-of-stream frame when given. */
  end(err?: unknown): void;
  readonly closed: boolean;
  /** Called once when the client goes away or the stream ends. */
  onClose(fn: () => void): void;
}

/**
 * What a server stream may hold for a client that reads slower than its sandbox writes (bytes not yet taken by the
 * client's connection). One agent socket carries every process of a machine, so a slow client cannot pause its
 * process without pausing the others: past this its stream ends with `resource_exhausted` (the process goes on, and
 * `connect(pid)` attaches again), instead of the server holding the sandbox's output without bound.
 */
export const MAX_UNSENT_BYTES = 32 * 1024 * 1024;

/** Starts a server-streaming response; the caller's handler returns what this returns. */
export function openServerStream(reply: FastifyReply): { stream: ServerStream; response: FastifyReply } {
  const out = new PassThrough();
  let closed = false;
  const closers: (() => void)[] = [];
  const close = () => {
    if (closed) return;
    closed = true;
    for (const fn of closers.splice(0)) fn();
  };
  // The response's close (not the request's, which closes once its body is read) means the client went away.
  reply.raw.once("close", close);
  const stream: ServerStream = {
    send(message) {
      if (closed) return;
      out.write(envelope(0, message));
      if (out.writableLength + out.readableLength > MAX_UNSENT_BYTES) {
        stream.end(new ConnectFailure("resource_exhausted", `the client fell more than ${MAX_UNSENT_BYTES / 1024 / 1024} MiB behind this stream; this stream ends (a process goes on: connect to it again)`));
      }
    },
    end(err) {
      if (closed) return;
      out.end(envelope(0x02, err === undefined ? {} : { error: connectError(err) }));
      close();
    },
    get closed() {
      return closed;
    },
    onClose(fn) {
      if (closed) fn();
      else closers.push(fn);
    },
  };
  const response = reply.code(200).type("application/connect+json").header("cache-control", "no-cache").send(out);
  return { stream, response };
}
