// The one logger factory: JSON lines by default, pretty on a TTY, and secrets redacted before anything is written.
// Redaction covers header/body fields by name and the edge_token query parameter inside logged URLs.

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
  "token",
  "secrets",
  "envs",
  "edge_token",
  "api_key",
  "apiKey",
  "key",
] as const;

const redactPaths = SECRET_FIELDS.flatMap((f) => [f, `*.${f}`, `*.*.${f}`, `*.*.*.${f}`]).concat([
  'req.headers["x-api-key"]',
  "req.headers.cookie",
]);

/** Removes the value of edge_token (and any *token*) query parameters from a URL or path. */
export function scrubUrl(url: string): string {
  return url.replace(/([?&][^=&#]*token[^=&#]*=)[^&#]*/gi, "$1[Redacted]");
}

export function createLogger(opts: { level?: string; pretty?: boolean; destination?: pino.DestinationStream } = {}): Logger {
  const options: pino.LoggerOptions = {
    level: opts.level ?? "info",
    redact: { paths: redactPaths, censor: "[Redacted]" },
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
  return pino(options);
}
