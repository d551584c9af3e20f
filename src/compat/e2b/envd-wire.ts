// What every envd protocol file shares: the kit envdRoutes hands them (the machine of a request, path resolution,
// the Connect unary and server-stream registrars) and the checks of request fields in Connect's error words.

import type { FastifyInstance, FastifyRequest } from "fastify";
import type { Services } from "../../services/index.ts";
import { ConnectFailure } from "./connect.ts";
import type { ServerStream } from "./connect.ts";
import type { ProcessRegistry } from "./processes.ts";

export const KEEPALIVE_DEFAULT_S = 50;

/** How often a stream sends keepalives: the client's Keepalive-Ping-Interval (seconds), at least 1. */
export function keepaliveEveryS(req: FastifyRequest): number {
  return Math.max(1, Number(req.headers["keepalive-ping-interval"]) || KEEPALIVE_DEFAULT_S);
}

export interface EnvdKit {
  app: FastifyInstance;
  services: Services;
  processes: ProcessRegistry;
  bodyLimit: number;
  /** The sandbox an envd request names. */
  sandboxIdOf(req: FastifyRequest): string;
  /** The machine, the acting user and that user's home (cached: homes do not move while a machine runs). */
  context(req: FastifyRequest): Promise<{ id: string; user: string; home: string }>;
  /** Relative paths resolve from the user's home, as envd does. */
  resolvePath(path: string, home: string): string;
  unary(method: string, fn: (msg: Record<string, unknown>, req: FastifyRequest) => Promise<unknown>): void;
  serverStream(method: string, fn: (msg: Record<string, unknown>, req: FastifyRequest, stream: () => ServerStream) => Promise<void>): void;
}

// ── Request fields ────────────────────────────────────────────────────────────────────────────────────────────

export const isObj = (v: unknown): v is Record<string, unknown> => typeof v === "object" && v !== null && !Array.isArray(v);

export function str(v: unknown, name: string, opts: { optional?: boolean } = {}): string | undefined {
  if (v === undefined || v === null) {
    if (opts.optional) return undefined;
    throw new ConnectFailure("invalid_argument", `${name} is required`);
  }
  if (typeof v !== "string") throw new ConnectFailure("invalid_argument", `${name} must be a string`);
  return v;
}

export function uint(v: unknown, name: string): number | undefined {
  if (v === undefined || v === null) return undefined;
  const n = typeof v === "string" ? Number(v) : v;
  if (typeof n !== "number" || !Number.isInteger(n) || n < 0 || n > 0xffffffff) throw new ConnectFailure("invalid_argument", `${name} must be a non-negative integer`);
  return n;
}

export function base64Of(v: unknown, name: string): string {
  if (typeof v !== "string" || !/^[A-Za-z0-9+/_-]*={0,2}$/.test(v)) throw new ConnectFailure("invalid_argument", `${name} must be base64 bytes`);
  return Buffer.from(v, "base64").toString("base64");
}

