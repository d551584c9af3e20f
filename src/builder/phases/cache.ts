// Cache phase: the final-artifact tier. An artifact built from the same input (still on disk) is reused and no
// step runs; skip_cache bypasses the lookup.

import type { BuilderPhase } from "./phase.ts";

export const cachePhase: BuilderPhase = {
  name: "cache",
  applies: () => true,
  async run(run, env) {
    const { p } = run;
    run.reused = p.request.skip_cache ? null : await env.artifacts.find(run.srcDigest!);
    if (p.request.skip_cache) {
      run.count("final_artifact_bypasses");
      run.emit({ kind: "cache", phase: "cache", cache_layer: "final_artifact", cache_outcome: "bypass", cache_reason: "whole_build_skip_cache", cache_target: p.name, message: "skip_cache: every step runs" });
      return;
    }
    const reused = run.reused;
    run.count(reused ? "final_artifact_hits" : "final_artifact_misses");
    run.emit(
      reused
        ? { kind: "cache", phase: "cache", cache_layer: "final_artifact", cache_outcome: "hit", cache_target: p.name, message: `cache hit: artifact ${reused.id} was built from the same input; no step runs` }
        : { kind: "cache", phase: "cache", cache_layer: "final_artifact", cache_outcome: "miss", cache_reason: "missing_or_incompatible", cache_target: p.name, message: "no artifact was built from this input yet" },
    );
  },
};
