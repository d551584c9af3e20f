// Kiln's configuration: read from KILN_* environment variables (the CLI maps its flags onto the same names),
// validated once at start so a bad value stops the server with a message that names the variable.

import { resolve } from "node:path";

export interface Config {
  host: string;
  port: number;
  dataDir: string;
  /** Where slow-to-make, shareable things live (the base template). */
  cacheDir: string;
  databaseUrl: string | undefined;
  driver: "oci";
  ociRuntime: "runc" | "runsc";
  /** gVisor's way of intercepting a machine's system calls (runsc only). */
  runscPlatform: "ptrace" | "systrap" | "kvm";
  publicUrl: string;
  apiKey: string | undefined;
  machineHostAccess: boolean;
  wsPingIntervalMs: number;
  logLevel: string;
  bodyLimitBytes: number;
  debianMirror: string | undefined;
  /** Machines of the base template kept booted ahead of time (0 turns the pool off). */
  warmPool: number;
  /** Registry hosts (host or host:port) image imports and Dockerfile builds reach over plain HTTP. */
  insecureRegistries: string[];
  /** A BuildKit daemon for Dockerfile builds (BuildKit's own BUILDKIT_HOST); unset builds with Buildah. */
  buildkitHost: string | undefined;
}

export class ConfigError extends Error {}

type Env = Record<string, string | undefined>;

/** Every variable Kiln reads, with what it means; the CLI's --help and the README table come from here. */
export const CONFIG_VARS = [
  ["KILN_HOST", "127.0.0.1", "address to listen on"],
  ["KILN_PORT", "8080", "port to listen on"],
  ["KILN_DATA_DIR", "./.kiln", "store, machines, keys"],
  ["KILN_CACHE_DIR", "$KILN_DATA_DIR/cache", "base template and other shareable caches"],
  ["KILN_DATABASE_URL", "(SQLite at $KILN_DATA_DIR/kiln.db)", "postgres://… to use PostgreSQL"],
  ["KILN_DRIVER", "oci", "machine driver"],
  ["KILN_OCI_RUNTIME", "runc", "runc, or runsc for gVisor"],
  ["KILN_RUNSC_PLATFORM", "ptrace", "gVisor platform: ptrace, systrap or kvm (runsc only)"],
  ["KILN_PUBLIC_URL", "http://$KILN_HOST:$KILN_PORT", "base of public (edge) URLs"],
  ["KILN_API_KEY", "(none)", "an API key the server accepts; stored hashed"],
  ["KILN_MACHINE_HOST_ACCESS", "0", "1 makes the host's loopback reachable in machines as host.kiln.internal"],
  ["KILN_LOG_LEVEL", "info", "pino level: trace, debug, info, warn, error"],
  ["KILN_BODY_LIMIT_BYTES", "104857600", "largest request body accepted (file uploads included)"],
  ["KILN_DEBIAN_MIRROR", "(the host's apt mirror)", "Debian mirror used to make the base template"],
  ["KILN_WARM_POOL", "2", "machines of the base template kept booted ahead of time (0: none)"],
  ["KILN_INSECURE_REGISTRIES", "(none)", "comma-separated registry hosts (host[:port]) reached over plain HTTP"],
] as const;

export function loadConfig(env: Env = process.env): Config {
  const host = env.KILN_HOST || "127.0.0.1";
  const port = intVar(env, "KILN_PORT", 8080, 0, 65535);
  const dataDir = resolve(env.KILN_DATA_DIR || "./.kiln");
  const databaseUrl = env.KILN_DATABASE_URL || undefined;
  if (databaseUrl && !/^postgres(ql)?:\/\//.test(databaseUrl)) {
    throw new ConfigError("KILN_DATABASE_URL must start with postgres:// or postgresql:// (leave it unset for SQLite)");
  }
  const driver = oneOf(env, "KILN_DRIVER", ["oci"] as const, "oci");
  const ociRuntime = oneOf(env, "KILN_OCI_RUNTIME", ["runc", "runsc"] as const, "runc");
  const publicUrl = (env.KILN_PUBLIC_URL || `http://${host}:${port}`).replace(/\/+$/, "");
  try {
    new URL(publicUrl);
  } catch {
    throw new ConfigError(`KILN_PUBLIC_URL is not a URL: ${JSON.stringify(publicUrl)}`);
  }
  const apiKey = env.KILN_API_KEY || undefined;
  if (apiKey !== undefined && apiKey.length < 16) throw new ConfigError("KILN_API_KEY must be at least 16 characters");
  return {
    host,
    port,
    dataDir,
    cacheDir: resolve(env.KILN_CACHE_DIR || `${dataDir}/cache`),
    databaseUrl,
    driver,
    ociRuntime,
    runscPlatform: oneOf(env, "KILN_RUNSC_PLATFORM", ["ptrace", "systrap", "kvm"] as const, "ptrace"),
    publicUrl,
    apiKey,
    machineHostAccess: boolVar(env, "KILN_MACHINE_HOST_ACCESS"),
    wsPingIntervalMs: intVar(env, "KILN_WS_PING_INTERVAL_MS", 15_000, 10, 3_600_000),
    logLevel: oneOf(env, "KILN_LOG_LEVEL", ["trace", "debug", "info", "warn", "error", "fatal", "silent"] as const, "info"),
    bodyLimitBytes: intVar(env, "KILN_BODY_LIMIT_BYTES", 100 * 1024 * 1024, 1024, 16 * 1024 * 1024 * 1024),
    debianMirror: env.KILN_DEBIAN_MIRROR || undefined,
    warmPool: intVar(env, "KILN_WARM_POOL", 2, 0, 64),
    insecureRegistries: registryList(env, "KILN_INSECURE_REGISTRIES"),
    buildkitHost: env.BUILDKIT_HOST || undefined,
  };
}

function intVar(env: Env, name: string, fallback: number, min: number, max: number): number {
  const raw = env[name];
  if (raw === undefined || raw === "") return fallback;
  const n = Number(raw);
  if (!Number.isInteger(n) || n < min || n > max) {
    throw new ConfigError(`${name} must be an integer from ${min} to ${max}, got ${JSON.stringify(raw)}`);
  }
  return n;
}

function registryList(env: Env, name: string): string[] {
  const hosts = (env[name] ?? "").split(",").map((h) => h.trim()).filter(Boolean);
  for (const h of hosts) {
    if (!/^[A-Za-z0-9.-]+(:\d{1,5})?$/.test(h)) throw new ConfigError(`${name} must list registry hosts as host or host:port, got ${JSON.stringify(h)}`);
  }
  return hosts;
}

function boolVar(env: Env, name: string): boolean {
  const raw = (env[name] ?? "").toLowerCase();
  if (["", "0", "false", "no"].includes(raw)) return false;
  if (["1", "true", "yes"].includes(raw)) return true;
  throw new ConfigError(`${name} must be 1 or 0, got ${JSON.stringify(env[name])}`);
}

function oneOf<const T extends readonly string[]>(env: Env, name: string, allowed: T, fallback: T[number]): T[number] {
  const raw = env[name];
  if (raw === undefined || raw === "") return fallback;
  if (!allowed.includes(raw)) throw new ConfigError(`${name} must be one of ${allowed.join(", ")}, got ${JSON.stringify(raw)}`);
  return raw;
}
