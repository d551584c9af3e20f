// SPEC.md's vocabulary for template builds, said once: every schema, record and log entry imports these.

export const BUILD_STATUSES = ["waiting", "building", "ready", "error", "cancelled"] as const;
export type BuildStatus = (typeof BUILD_STATUSES)[number];

export const BUILD_BACKENDS = ["native", "buildkit"] as const;
export type BuildBackendName = (typeof BUILD_BACKENDS)[number];

export const SOURCE_TYPES = ["declarative", "dockerfile", "oci_import", "template_base"] as const;
export type SourceType = (typeof SOURCE_TYPES)[number];

export const LOG_KINDS = ["start", "message", "cache", "retry", "warning", "error", "cancelled", "end"] as const;
export type LogKind = (typeof LOG_KINDS)[number];
export const TERMINAL_KINDS: readonly LogKind[] = ["end", "error", "cancelled"];

export const LOG_LEVELS = ["debug", "info", "warn", "error"] as const;
export type LogLevel = (typeof LOG_LEVELS)[number];

export const BUILD_PHASES = ["cache", "preparing", "vm_create", "step", "sync", "startup", "readiness", "snapshot", "finalize", "cleanup", "retry"] as const;
export type BuildPhase = (typeof BUILD_PHASES)[number];

export const CACHE_LAYERS = ["file_blob", "layer", "final_artifact"] as const;
export type CacheLayer = (typeof CACHE_LAYERS)[number];

export const CACHE_OUTCOMES = ["hit", "miss", "stored", "bypass"] as const;
export type CacheOutcome = (typeof CACHE_OUTCOMES)[number];

export const CACHE_REASONS = ["whole_build_skip_cache", "builder_cache_boundary", "force_upload", "missing_or_incompatible"] as const;
export type CacheReason = (typeof CACHE_REASONS)[number];

/** cache_summary's counters: `<layer>_<hits|misses|bypasses|stores>`. */
export const CACHE_COUNTER_SUFFIX: Record<CacheOutcome, string> = { hit: "hits", miss: "misses", bypass: "bypasses", stored: "stores" };

export function emptyCacheSummary(): Record<string, number> {
  const out: Record<string, number> = {};
  for (const layer of CACHE_LAYERS) for (const suffix of Object.values(CACHE_COUNTER_SUFFIX)) out[`${layer}_${suffix}`] = 0;
  return out;
}
