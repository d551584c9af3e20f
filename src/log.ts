// The one logger factory: JSON lines by default, pretty on a TTY, and secrets redacted before anything is written.
// Redaction covers header/body fields by name and the edge_token and signature query parameters inside logged URLs.

import pino from "pino";
import type { Logger } from "pino";

export type { Logger };

/** Field names whose values never reach a log line, wherever they appear (two levels deep). */
export const SECRET_FIELDS = [
  "authorization",
  "password",
  "private_key",
  "passphrase",
  "signing_secret",
  "signingSecret",
  "previous_signing_secret",
  "secret",
  "token",
  "secrets",
  "envs",
  "stdin",
  "edge_token",
  "api_key",
  "apiKey",
  "key",
  "cookie",
  "set-cookie",
  "public_url",
  "x-api-key",
  "sec-websocket-protocol",
  "build_envs",
  "name_claim_token",
  "base_image_auth",
  "registry_credentials",
  "x-access-token",
  "envdAccessToken",
  "envVars",
] as const;

const SECRET_SET = new Set<string>(SECRET_FIELDS);

/**
 * Replaces the value of every secret-named field, at any depth, in what is about to be logged. Walking the
 * (small) log object by key name is both stricter and cheaper than a list of wildcard paths.
 */
export function redactDeep(value: unknown, depth = 0): unknown {
  if (depth > 8 || value === null || typeof value !== "object") return value;
  if (Array.isArray(value)) return value.map((v) => redactDeep(v, depth + 1));
  // Only plain data is walked: class instances (requests, sockets, errors) are left to their serializers.
  const proto = Object.getPrototypeOf(value);
  if (proto !== Object.prototype && proto !== null) return value;
  let out: Record<string, unknown> | undefined;
  for (const [k, v] of Object.entries(value as Record<string, unknown>)) {
    const next = SECRET_SET.has(k) || SECRET_SET.has(k.toLowerCase()) ? "[Redacted]" : redactDeep(v, depth + 1);
    if (next !== v) {
      out ??= { ...(value as Record<string, unknown>) };
      out[k] = next;
    }
  }
  return out ?? value;
}

/** Removes the value of edge_token (and any *token*) and signature (E2B's signed file URLs) query parameters from a URL or path. */
export function scrubUrl(url: string): string {
  if (!url.includes("=")) return url; // no parameter value: nothing to scrub (the common case, on every request line)
  return url.replace(/([?&][^=&#]*(?:token|signature)[^=&#]*=)[^&#]*/gi, "$1[Redacted]");
}

export function createLogger(opts: { level?: string; pretty?: boolean; destination?: pino.DestinationStream } = {}): Logger {
  const options: pino.LoggerOptions = {
    level: opts.level ?? "info",
    formatters: { log: (obj) => redactDeep(obj) as Record<string, unknown> },
    serializers: {
      req(req: { id?: string; method?: string; url?: string; remoteAddress?: string }) {
        return { id: req.id, method: req.method, url: scrubUrl(req.url ?? ""), remoteAddress: req.remoteAddress };
      },
      res(res: { statusCode?: number }) {
        return { statusCode: res.statusCode };
      },
      err: pino.stdSerializers.err,
    },
  };
  if (opts.destination) return pino(options, opts.destination);
  const pretty = opts.pretty ?? Boolean(process.stdout.isTTY);
  if (pretty) return pino({ ...options, transport: { target: "pino-pretty", options: { colorize: true } } });
  return pino(options, bufferedDestination(1));
}

/**
 * Where a server's log lines go: buffered, written when LOG_BUFFER_BYTES gather or every LOG_FLUSH_MS, and flushed
 * synchronously when the process exits (pino registers that), instead of one write(2) per line. A request line then
 * costs its formatting, not a system call; a kill -9 can lose at most the last LOG_FLUSH_MS of lines.
 *
 * Lines are kept as Buffers (sonic-boom's buffer mode): its text mode measures the whole pending string on every
 * line (Buffer.byteLength of a growing concatenation), which cost more per request line than formatting it. While
 * the output does not drain (a stuck pipe), lines past LOG_BUFFER_MAX_BYTES are dropped instead of held, and counted.
 */
export function bufferedDestination(dest: number | string): pino.DestinationStream {
  const stream = pino.destination({ dest, sync: false, contentMode: "buffer", minLength: LOG_BUFFER_BYTES, maxWrite: LOG_WRITE_MAX_BYTES, maxLength: LOG_BUFFER_MAX_BYTES, periodicFlush: LOG_FLUSH_MS });
  // pino writes strings; buffer mode takes Buffers. The instance keeps its own flush/flushSync/end (pino's exit flush).
  const writeBuffer = stream.write.bind(stream) as unknown as (data: Buffer) => boolean;
  // Lines dropped are said, not silent: once the output drains to half the bound, the next line written after them
  // is preceded by one warning with their count — so a reader of the log knows lines (a security warning among them,
  // perhaps) went missing, and how many. `pending`: bytes taken and not yet written (sonic-boom's own count is private).
  let pending = 0;
  let dropped = 0;
  let lastDropped = false;
  stream.on("drop", () => {
    lastDropped = true;
    dropped++;
  });
  stream.on("write", (n: number) => (pending -= n));
  const put = (data: Buffer) => {
    lastDropped = false;
    const ok = writeBuffer(data);
    if (!lastDropped) pending += data.length;
    return ok;
  };
  stream.write = (line: string) => {
    if (dropped > 0 && pending < LOG_BUFFER_MAX_BYTES / 2) {
      const n = dropped;
      dropped = 0;
      put(Buffer.from(`${JSON.stringify({ level: 40, time: Date.now(), pid: process.pid, dropped_lines: n, msg: "log lines dropped: the log output did not drain" })}\n`));
    }
    return put(Buffer.from(line));
  };
  return stream;
}
const LOG_BUFFER_BYTES = 32 * 1024;
const LOG_WRITE_MAX_BYTES = 64 * 1024;
const LOG_BUFFER_MAX_BYTES = 16 * 1024 * 1024;
const LOG_FLUSH_MS = 100;
