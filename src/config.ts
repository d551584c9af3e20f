// Kiln's configuration: read from KILN_* environment variables (the CLI maps its flags onto the same names),
// validated once at start so a bad value stops the server with a message that names the variable.

import { hostname } from "node:os";
import { resolve } from "node:path";
import { DEFAULT_IMPORT_LIMITS } from "./builder/oci/limits.ts";
import type { ImportLimits } from "./builder/oci/limits.ts";
import { DEFAULT_PROXY_LIMITS } from "./deployments/proxy-limits.ts";
import type { ProxyLimits } from "./deployments/proxy-limits.ts";
import { parseEdgeDomain } from "./deployments/edge-origin.ts";
import type { EdgeDomain } from "./deployments/edge-origin.ts";

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
  /** KILN_EDGE_DOMAIN: deployments' pages each on an origin of their own, `<label>.<domain>`. */
  edgeDomain: EdgeDomain | undefined;
  apiKey: string | undefined;
  machineHostAccess: boolean;
  wsPingIntervalMs: number;
  logLevel: string;
  bodyLimitBytes: number;
  debianMirror: string | undefined;
  /** Machines of the base template kept booted ahead of time (0 turns the pool off). */
  warmPool: number;
  /** KILN_WARM_POOL_MAX: the most the base pool grows to with demand; "auto" derives it from the memory floors. */
  warmPoolMax: number | "auto";
  /** KILN_WARM_POOL_IDLE_S: a peak of creates keeps the grown pool this long. */
  warmPoolIdleMs: number;
  hotPools: { maxPerTemplate: number; maxTotal: number; hotAfter: number; idleMs: number };
  /** Registry hosts (host or host:port) image imports and Dockerfile builds reach over plain HTTP. */
  insecureRegistries: string[];
  /** Bounds on what an imported image may make Kiln read, hold and write (KILN_OCI_MAX_*). */
  ociLimits: ImportLimits;
  /** A BuildKit daemon for Dockerfile builds (BuildKit's own BUILDKIT_HOST); unset builds with Buildah. */
  buildkitHost: string | undefined;
  /** How long an artifact no tag points at is kept before its layers may be collected. */
  buildRetentionS: number;
  /** Dockerfile builds: one step (STEP n/m to the next) and the whole build are stopped after these. */
  buildStepTimeoutS: number;
  buildTimeoutS: number;
  /** A build log keeps at most this many bytes of entries; past it, one `log truncated` entry and then only the end. */
  buildLogMaxBytes: number;
  /** This host's id on a shared store; unset → made once into $KILN_DATA_DIR/host-id. */
  hostId: string | undefined;
  /** This host's name in GET /v1/hosts (KILN_HOST_NAME; default the OS hostname). */
  hostName: string;
  /** The URL the other servers on the store reach this one at (KILN_ADVERTISE_URL; default http://$KILN_HOST:$KILN_PORT). */
  advertiseUrl: string | undefined;
  /** A host whose heartbeat is older than this is marked lost by a surviving server. */
  hostLostAfterS: number;
  /** How often this server writes its heartbeat (and looks for lost hosts). */
  hostHeartbeatMs: number;
  /** Delay before each webhook delivery attempt (the first is usually 0); its length is the number of attempts. */
  webhookRetryScheduleMs: number[];
  webhookAllowPrivate: boolean;
  /** How long a rotated-out signing secret keeps signing beside the new one. */
  webhookRotationGraceMs: number;
  webhookHistoryS: number;
  /** Volume watch frames a socket may hold unsent per watch before it drops them for a resync_required. */
  volumeWatchQueue: number;
  /** Bytes of answers the MCP requests in flight may hold together (src/mcp/caller.ts). */
  mcpHeldMaxBytes: number;
  /** How long a stopping server lets open requests (streams included) finish before it closes their connections. */
  shutdownGraceMs: number;
  /** Supervised deployment services: crashes in a row before `failed`, and the first restart delay. */
  serviceMaxCrashes: number;
  serviceBackoffMs: number;
  /** Lifetime of a signed edge_token in a service's public URL. */
  edgeTokenTtlS: number;
  /** KILN_DEPLOYMENT_ENVS_KEY_FILE: a key file sealing deployment envs that every server of a store is given. */
  deploymentEnvsKeyFile: string | undefined;
  /** Each service's (and sandbox port's) share and waits through the edge. */
  edgeLimits: ProxyLimits;
  /** Largest `disk_mb` a machine may ask for. */
  maxDiskMb: number;
  /** Creates answer 503 while the data dir's filesystem has less free space than this. */
  minFreeDiskMb: number;
  /** Creates answer 503 while the host's MemAvailable is below this; undefined: 10 % of the host's RAM. */
  minFreeMemoryMb: number | undefined;
  /** When set, the declared memory of live machines may not exceed this multiple of the host's RAM. */
  memoryOvercommit: number | undefined;
  /** `auto`: each machine on its own host uid range where the host allows it; `shared`: every machine on one. */
  machineIdentity: "auto" | "shared";
  /** The host-wide directory of machines' uid range claims (one per host, shared by every server on it). */
  idRangesDir: string;
  /** Caps on all machines together (Kiln's parent cgroup); undefined: the driver's defaults from the host. */
  machinesPidsMax: number | undefined;
  machinesMemoryMb: number | undefined;
  /** `auto`: machines' disks and snapshots on a filesystem that can reflink (an XFS file in the data dir if need be); `off`: plain copies. */
  diskPool: "auto" | "off";
  /** Snapshots one host keeps (ready or being taken). */
  maxSnapshots: number;
  /** gVisor: memory snapshots whose disk is kept copied and mounted ahead (the least recently used given up first). */
  snapshotSpares: number;
  /** How long a machine with on_timeout "hibernate" may sleep before it is destroyed. */
  maxHibernationS: number;
}

/** DESIGN.md §4: immediately, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h. */
export const DEFAULT_WEBHOOK_RETRY_SCHEDULE_MS = [0, 5_000, 300_000, 1_800_000, 7_200_000, 18_000_000, 36_000_000, 36_000_000];

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
  ["KILN_EDGE_DOMAIN", "(none: /edge/<id>/ on KILN_PUBLIC_URL)", "wildcard domain (host[:port]) giving each deployment's pages their own origin, <id>.<domain>"],
  ["KILN_API_KEY", "(none)", "an API key the server accepts; stored hashed"],
  ["KILN_MACHINE_HOST_ACCESS", "0", "1 makes the host's loopback reachable in machines as host.kiln.internal"],
  ["KILN_LOG_LEVEL", "info", "pino level: trace, debug, info, warn, error"],
  ["KILN_BODY_LIMIT_BYTES", "104857600", "largest request body accepted (file uploads and build-context blobs included)"],
  ["KILN_DEBIAN_MIRROR", "(the host's apt mirror)", "Debian mirror used to make the base template"],
  ["KILN_WARM_POOL", "2", "machines of the base template kept booted ahead of time (0: none)"],
  ["KILN_WARM_POOL_MAX", "auto", "the base template's pool grows with its create rate (the most creates within a second, held KILN_WARM_POOL_IDLE_S) up to this many, above the admission floors; auto: the memory floor (KILN_MIN_FREE_MEMORY_MB) over 32 MiB per idle machine, at most 256 and what KILN_MEMORY_OVERCOMMIT admits (0: fixed at KILN_WARM_POOL)"],
  ["KILN_WARM_POOL_IDLE_S", "60", "a grown base pool shrinks back to KILN_WARM_POOL this long after its creates stop"],
  ["KILN_HOT_POOL_MAX", "2", "most machines kept booted for one often-created template other than the base (0: no hot pools)"],
  ["KILN_HOT_POOL_TOTAL", "4", "most machines all hot-template pools keep together"],
  ["KILN_HOT_POOL_AFTER", "2", "creates of a template within KILN_HOT_POOL_IDLE_S that give it a pool"],
  ["KILN_HOT_POOL_IDLE_S", "300", "a template not created for this long loses its pool (demand is counted over it)"],
  ["KILN_INSECURE_REGISTRIES", "(none)", "comma-separated registry hosts (host[:port]) reached over plain HTTP"],
  ["KILN_OCI_MAX_MANIFEST_BYTES", "4194304", "largest image manifest or index an import reads"],
  ["KILN_OCI_MAX_CONFIG_BYTES", "8388608", "largest image config an import reads"],
  ["KILN_OCI_MAX_ENTRY_BYTES", "8589934592", "largest single file in an imported layer"],
  ["KILN_OCI_MAX_IMAGE_BYTES", "34359738368", "most uncompressed layer bytes one import unpacks (and compressed bytes it declares)"],
  ["KILN_OCI_MAX_LAYERS", "39", "most layers an imported image may have (at most 39: a machine stacks 40, Kiln adds one)"],
  ["KILN_OCI_MAX_LAYER_ENTRIES", "1000000", "most entries (files, dirs, links, whiteouts) in one imported layer"],
  ["KILN_BUILD_RETENTION_S", "604800", "seconds an untagged template artifact is kept before the collector removes it"],
  ["KILN_BUILD_STEP_TIMEOUT_S", "3600", "a build step (a Dockerfile RUN, a step's run command) running longer than this is killed and the build fails"],
  ["KILN_BUILD_TIMEOUT_S", "14400", "a build (Dockerfile or steps) running longer than this is killed and fails"],
  ["KILN_BUILD_LOG_MAX_BYTES", "134217728", "bytes of log entries a build keeps; past it, a `log truncated` entry and its last entries"],
  ["KILN_HOST_ID", "(made once into $KILN_DATA_DIR/host-id)", "this host's id when several servers share one store"],
  ["KILN_HOST_NAME", "(the OS hostname)", "this host's name in GET /v1/hosts"],
  ["KILN_ADVERTISE_URL", "http://$KILN_HOST:$KILN_PORT", "the URL the other servers on one store reach this one at (docs/hosts.md)"],
  ["KILN_HOST_LOST_AFTER_S", "30", "a host whose heartbeat is older than this is marked lost and its machines failed"],
  ["KILN_HOST_HEARTBEAT_MS", "5000", "how often a server writes its host's heartbeat"],
  ["KILN_WEBHOOK_RETRY_SCHEDULE_MS", "0,5000,300000,1800000,7200000,18000000,36000000,36000000", "delay before each webhook delivery attempt, comma-separated"],
  ["KILN_WEBHOOK_ALLOW_PRIVATE", "0", "1 lets webhooks reach private and loopback addresses (link-local never)"],
  ["KILN_WEBHOOK_HISTORY_S", "2592000", "seconds a finished webhook delivery (succeeded or dead-lettered), its attempts and its event are kept (0: forever)"],
  ["KILN_WEBHOOK_ROTATION_GRACE_MS", "86400000", "how long a rotated-out webhook signing secret keeps signing"],
  ["KILN_VOLUME_WATCH_QUEUE", "4096", "volume watch events held per watch for a slow client before resync_required"],
  ["KILN_MCP_HELD_MAX_MB", "128", "MiB of Kiln's answers all MCP requests in flight may hold; past it a tool call answers unavailable (retryable)"],
  ["KILN_SHUTDOWN_GRACE_MS", "5000", "how long a stopping server lets open requests and streams finish before it closes their connections (machines keep running)"],
  ["KILN_SERVICE_MAX_CRASHES", "5", "crashes in a row after which a deployment's service ends failed"],
  ["KILN_SERVICE_BACKOFF_MS", "500", "first delay before a crashed service starts again (doubles per crash, up to 30 s)"],
  ["KILN_EDGE_TOKEN_TTL_S", "3600", "lifetime of the signed edge_token of a deployment with access: signed (a fresh one on every read)"],
  ["KILN_DEPLOYMENT_ENVS_KEY_FILE", "$KILN_DATA_DIR/deployment-envs-key", "key file (64 hex characters, mode 0600) sealing deployment envs; give every server of one store the same file so any of them can start any deployment's replicas"],
  ["KILN_EDGE_MAX_CONNECTIONS", "64", "requests in flight at once to one service (or sandbox port) through the edge"],
  ["KILN_EDGE_QUEUE", "256", "requests that may wait for one of those; past it the edge answers 503 at once"],
  ["KILN_EDGE_HEADERS_TIMEOUT_S", "60", "longest wait through the edge for a place, and for a service's response head (504)"],
  ["KILN_EDGE_IDLE_TIMEOUT_S", "300", "longest silence of a request or response body through the edge"],
  ["KILN_EDGE_REQUEST_TIMEOUT_S", "300", "longest time to receive a whole request body through the edge, however steadily it drips (then 504)"],
  ["KILN_MAX_DISK_MB", "102400", "largest disk_mb a machine may ask for (its writable layer; default 10240)"],
  ["KILN_MIN_FREE_DISK_MB", "2048", "creates answer 503 while the data dir has less free disk than this"],
  ["KILN_MIN_FREE_MEMORY_MB", "(10 % of RAM)", "creates answer 503 while the host's available memory is below this"],
  ["KILN_MEMORY_OVERCOMMIT", "(unset)", "caps the declared memory of live machines at this multiple of RAM (e.g. 4)"],
  ["KILN_MACHINE_IDENTITY", "auto", "auto: each machine on its own host uid range (idmapped mounts) where the host allows; shared: one range for all"],
  ["KILN_ID_RANGES_DIR", "/var/lib/kiln/id-ranges", "host-wide claims of machines' uid ranges: every server on a host must use the same"],
  ["KILN_MACHINES_PIDS_MAX", "(¾ of the host's pid_max)", "processes and threads of all machines together (Kiln's parent cgroup)"],
  ["KILN_MACHINES_MEMORY_MB", "(RAM less 10 %, at least 1 GiB)", "memory of all machines together (Kiln's parent cgroup)"],
  ["KILN_DISK_POOL", "auto", "auto: machines' disks and snapshots on a filesystem that reflinks (an XFS file in the data dir when its own cannot); off: plain copies"],
  ["KILN_MAX_SNAPSHOTS", "1000", "snapshots one host keeps (ready or being taken); past it a snapshot or fork answers 409"],
  ["KILN_SNAPSHOT_SPARES", "4", "gVisor: memory snapshots whose disk is kept copied and mounted ahead (one loop device each), so a machine restored from one skips that step; 0: none"],
  ["KILN_MAX_HIBERNATION_S", "2592000", "how long a machine with on_timeout \"hibernate\" may sleep before it is destroyed (default 30 days)"],
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
  const edgeDomain: EdgeDomain | undefined = env.KILN_EDGE_DOMAIN ? parseEdgeDomain(env.KILN_EDGE_DOMAIN) : undefined;
  if (env.KILN_EDGE_DOMAIN && !edgeDomain) {
    throw new ConfigError(`KILN_EDGE_DOMAIN must be a host name with an optional port (edge.example.com, localhost:8080), not ${JSON.stringify(env.KILN_EDGE_DOMAIN)}`);
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
    edgeDomain,
    apiKey,
    machineHostAccess: boolVar(env, "KILN_MACHINE_HOST_ACCESS"),
    wsPingIntervalMs: intVar(env, "KILN_WS_PING_INTERVAL_MS", 15_000, 10, 3_600_000),
    logLevel: oneOf(env, "KILN_LOG_LEVEL", ["trace", "debug", "info", "warn", "error", "fatal", "silent"] as const, "info"),
    bodyLimitBytes: intVar(env, "KILN_BODY_LIMIT_BYTES", 100 * 1024 * 1024, 1024, 16 * 1024 * 1024 * 1024),
    debianMirror: env.KILN_DEBIAN_MIRROR || undefined,
    warmPool: intVar(env, "KILN_WARM_POOL", 2, 0, 64),
    warmPoolMax: autoOrIntVar(env, "KILN_WARM_POOL_MAX", 0, 256),
    warmPoolIdleMs: intVar(env, "KILN_WARM_POOL_IDLE_S", 60, 1, 86_400) * 1000,
    hotPools: {
      maxPerTemplate: intVar(env, "KILN_HOT_POOL_MAX", 2, 0, 64),
      maxTotal: intVar(env, "KILN_HOT_POOL_TOTAL", 4, 0, 256),
      hotAfter: intVar(env, "KILN_HOT_POOL_AFTER", 2, 1, 1000),
      idleMs: intVar(env, "KILN_HOT_POOL_IDLE_S", 300, 5, 86_400) * 1000,
    },
    insecureRegistries: registryList(env, "KILN_INSECURE_REGISTRIES"),
    ociLimits: {
      manifestBytes: intVar(env, "KILN_OCI_MAX_MANIFEST_BYTES", DEFAULT_IMPORT_LIMITS.manifestBytes, 4096, 1 << 30),
      configBytes: intVar(env, "KILN_OCI_MAX_CONFIG_BYTES", DEFAULT_IMPORT_LIMITS.configBytes, 4096, 1 << 30),
      entryBytes: intVar(env, "KILN_OCI_MAX_ENTRY_BYTES", DEFAULT_IMPORT_LIMITS.entryBytes, 1, 2 ** 50),
      imageBytes: intVar(env, "KILN_OCI_MAX_IMAGE_BYTES", DEFAULT_IMPORT_LIMITS.imageBytes, 1, 2 ** 50),
      layers: intVar(env, "KILN_OCI_MAX_LAYERS", DEFAULT_IMPORT_LIMITS.layers, 1, DEFAULT_IMPORT_LIMITS.layers),
      layerEntries: intVar(env, "KILN_OCI_MAX_LAYER_ENTRIES", DEFAULT_IMPORT_LIMITS.layerEntries, 1, 100_000_000),
    },
    buildkitHost: env.BUILDKIT_HOST || undefined,
    buildRetentionS: intVar(env, "KILN_BUILD_RETENTION_S", 604_800, 0, 10 * 365 * 86_400),
    buildStepTimeoutS: intVar(env, "KILN_BUILD_STEP_TIMEOUT_S", 3600, 1, 7 * 86_400),
    buildTimeoutS: intVar(env, "KILN_BUILD_TIMEOUT_S", 14_400, 1, 7 * 86_400),
    buildLogMaxBytes: intVar(env, "KILN_BUILD_LOG_MAX_BYTES", 128 * 1024 * 1024, 64 * 1024, 64 * 1024 * 1024 * 1024),
    hostId: hostIdVar(env),
    hostName: hostNameVar(env),
    advertiseUrl: advertiseUrlVar(env),
    hostLostAfterS: intVar(env, "KILN_HOST_LOST_AFTER_S", 30, 2, 86_400),
    hostHeartbeatMs: intVar(env, "KILN_HOST_HEARTBEAT_MS", 5000, 100, 600_000),
    webhookRetryScheduleMs: scheduleVar(env, "KILN_WEBHOOK_RETRY_SCHEDULE_MS", DEFAULT_WEBHOOK_RETRY_SCHEDULE_MS),
    webhookAllowPrivate: boolVar(env, "KILN_WEBHOOK_ALLOW_PRIVATE"),
    webhookRotationGraceMs: intVar(env, "KILN_WEBHOOK_ROTATION_GRACE_MS", 86_400_000, 0, 30 * 86_400_000),
    webhookHistoryS: intVar(env, "KILN_WEBHOOK_HISTORY_S", 2_592_000, 0, 10 * 365 * 86_400),
    volumeWatchQueue: intVar(env, "KILN_VOLUME_WATCH_QUEUE", 4096, 1, 1_000_000),
    mcpHeldMaxBytes: intVar(env, "KILN_MCP_HELD_MAX_MB", 128, 1, 65_536) * 1024 * 1024,
    shutdownGraceMs: intVar(env, "KILN_SHUTDOWN_GRACE_MS", 5000, 0, 600_000),
    serviceMaxCrashes: intVar(env, "KILN_SERVICE_MAX_CRASHES", 5, 1, 1000),
    serviceBackoffMs: intVar(env, "KILN_SERVICE_BACKOFF_MS", 500, 0, 600_000),
    edgeTokenTtlS: intVar(env, "KILN_EDGE_TOKEN_TTL_S", 3600, 1, 30 * 24 * 3600),
    deploymentEnvsKeyFile: env.KILN_DEPLOYMENT_ENVS_KEY_FILE ? resolve(env.KILN_DEPLOYMENT_ENVS_KEY_FILE) : undefined,
    edgeLimits: {
      ...DEFAULT_PROXY_LIMITS,
      connections: intVar(env, "KILN_EDGE_MAX_CONNECTIONS", DEFAULT_PROXY_LIMITS.connections, 1, 4096),
      queue: intVar(env, "KILN_EDGE_QUEUE", DEFAULT_PROXY_LIMITS.queue, 0, 100_000),
      headersTimeoutMs: intVar(env, "KILN_EDGE_HEADERS_TIMEOUT_S", DEFAULT_PROXY_LIMITS.headersTimeoutMs / 1000, 1, 86_400) * 1000,
      idleTimeoutMs: intVar(env, "KILN_EDGE_IDLE_TIMEOUT_S", DEFAULT_PROXY_LIMITS.idleTimeoutMs / 1000, 1, 86_400) * 1000,
      requestTimeoutMs: intVar(env, "KILN_EDGE_REQUEST_TIMEOUT_S", DEFAULT_PROXY_LIMITS.requestTimeoutMs / 1000, 1, 86_400) * 1000,
    },
    maxDiskMb: intVar(env, "KILN_MAX_DISK_MB", 102_400, 128, 16 * 1024 * 1024),
    minFreeDiskMb: intVar(env, "KILN_MIN_FREE_DISK_MB", 2048, 0, 1 << 30),
    minFreeMemoryMb: env.KILN_MIN_FREE_MEMORY_MB ? intVar(env, "KILN_MIN_FREE_MEMORY_MB", 0, 0, 1 << 30) : undefined,
    memoryOvercommit: positiveNumberVar(env, "KILN_MEMORY_OVERCOMMIT"),
    machineIdentity: oneOf(env, "KILN_MACHINE_IDENTITY", ["auto", "shared"] as const, "auto"),
    idRangesDir: resolve(env.KILN_ID_RANGES_DIR || "/var/lib/kiln/id-ranges"),
    machinesPidsMax: env.KILN_MACHINES_PIDS_MAX ? intVar(env, "KILN_MACHINES_PIDS_MAX", 0, 64, 1 << 30) : undefined,
    machinesMemoryMb: env.KILN_MACHINES_MEMORY_MB ? intVar(env, "KILN_MACHINES_MEMORY_MB", 0, 64, 1 << 30) : undefined,
    diskPool: oneOf(env, "KILN_DISK_POOL", ["auto", "off"] as const, "auto"),
    maxSnapshots: intVar(env, "KILN_MAX_SNAPSHOTS", 1000, 0, 1_000_000),
    snapshotSpares: intVar(env, "KILN_SNAPSHOT_SPARES", 4, 0, 64),
    maxHibernationS: intVar(env, "KILN_MAX_HIBERNATION_S", 30 * 24 * 3600, 60, 365 * 24 * 3600),
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

/** "auto" (also when unset) or an integer in range. */
function autoOrIntVar(env: Env, name: string, min: number, max: number): number | "auto" {
  const raw = env[name];
  if (raw === undefined || raw === "" || raw === "auto") return "auto";
  const n = Number(raw);
  if (!Number.isInteger(n) || n < min || n > max) throw new ConfigError(`${name} must be auto or an integer from ${min} to ${max}, got ${JSON.stringify(raw)}`);
  return n;
}

function registryList(env: Env, name: string): string[] {
  const hosts = (env[name] ?? "").split(",").map((h) => h.trim()).filter(Boolean);
  for (const h of hosts) {
    if (!/^[A-Za-z0-9.-]+(:\d{1,5})?$/.test(h)) throw new ConfigError(`${name} must list registry hosts as host or host:port, got ${JSON.stringify(h)}`);
  }
  return hosts;
}

function hostNameVar(env: Env): string {
  const raw = env.KILN_HOST_NAME || hostname();
  if (!/^[A-Za-z0-9_.-]{1,128}$/.test(raw)) throw new ConfigError(`KILN_HOST_NAME must be 1 to 128 letters, digits, '.', '_' or '-', got ${JSON.stringify(raw.slice(0, 140))}`);
  return raw;
}

/** Unset: made from KILN_HOST/KILN_PORT once the server listens (app.ts), since port 0 is only known then. */
function advertiseUrlVar(env: Env): string | undefined {
  const raw = env.KILN_ADVERTISE_URL;
  if (!raw) return undefined;
  let url: URL;
  try {
    url = new URL(raw);
  } catch {
    throw new ConfigError(`KILN_ADVERTISE_URL must be an http(s) URL, got ${JSON.stringify(raw.slice(0, 200))}`);
  }
  if ((url.protocol !== "http:" && url.protocol !== "https:") || url.username || url.password || (url.pathname !== "/" && url.pathname !== "") || url.search || url.hash) {
    throw new ConfigError("KILN_ADVERTISE_URL must be a bare http(s)://host:port (no path, query or credentials)");
  }
  return url.origin;
}

function hostIdVar(env: Env): string | undefined {
  const raw = env.KILN_HOST_ID;
  if (raw === undefined || raw === "") return undefined;
  if (!/^[A-Za-z0-9_.-]{1,64}$/.test(raw)) throw new ConfigError(`KILN_HOST_ID must be 1 to 64 letters, digits, '.', '_' or '-', got ${JSON.stringify(raw)}`);
  return raw;
}

function scheduleVar(env: Env, name: string, fallback: number[]): number[] {
  const raw = env[name];
  if (raw === undefined || raw.trim() === "") return fallback;
  const parts = raw.split(",").map((p) => p.trim());
  const delays = parts.map(Number);
  if (parts.length > 50 || delays.some((d, i) => parts[i] === "" || !Number.isInteger(d) || d < 0 || d > 7 * 86_400_000)) {
    throw new ConfigError(`${name} must be a comma list of 1 to 50 delays in milliseconds (each 0 to 604800000), got ${JSON.stringify(raw)}`);
  }
  if (delays[0] !== 0) throw new ConfigError(`${name} must start with 0: an event's first delivery attempt goes at once, got ${JSON.stringify(raw)}`);
  return delays;
}

function positiveNumberVar(env: Env, name: string): number | undefined {
  const raw = env[name];
  if (raw === undefined || raw === "") return undefined;
  const n = Number(raw);
  if (!Number.isFinite(n) || n <= 0 || n > 1000) throw new ConfigError(`${name} must be a number above 0 (a multiple of the host's RAM), got ${JSON.stringify(raw)}`);
  return n;
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
