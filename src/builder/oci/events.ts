// An import's progress as build log entries and cache counters: download lines become `message` entries, each
// layer a `layer` cache entry (hit, miss, stored) counted like the native backend's layers.

import type { ImportEvents } from "./types.ts";

/** The slice of the build pipeline's log entry an import emits (structurally the pipeline's LogInput). */
export interface ImportLogEntry {
  kind: "message" | "cache";
  phase: "preparing" | "cache" | "finalize" | "step";
  message: string;
  step_index?: number;
  total_steps?: number;
  level?: "debug" | "info";
  cache_layer?: "layer";
  cache_outcome?: "hit" | "miss" | "stored";
  cache_reason?: "missing_or_incompatible";
  cache_target?: string;
}

export function importLogEvents(log: (entry: ImportLogEntry) => void, count: (counter: string) => void): Required<ImportEvents> {
  return {
    onMessage: (message) => log({ kind: "message", phase: "preparing", message }),
    onLayer: ({ digest, outcome }) => {
      const target = `image layer ${digest}`;
      if (outcome === "hit") {
        count("layer_hits");
        log({ kind: "cache", phase: "cache", cache_layer: "layer", cache_outcome: "hit", cache_target: target, message: `cache hit: ${target}` });
      } else if (outcome === "miss") {
        count("layer_misses");
        log({ kind: "cache", phase: "cache", cache_layer: "layer", cache_outcome: "miss", cache_reason: "missing_or_incompatible", cache_target: target, message: `cache miss: ${target}` });
      } else {
        count("layer_stores");
        log({ kind: "cache", phase: "cache", cache_layer: "layer", cache_outcome: "stored", cache_target: target, message: `cached: ${target}`, level: "debug" });
      }
    },
  };
}
