// Finalize phase: the artifact is recorded (or the reused one taken) and the build's tags move onto it.

import type { BuilderPhase } from "./phase.ts";

export const finalizePhase: BuilderPhase = {
  name: "finalize",
  applies: () => true,
  async run(run, env) {
    const { p } = run;
    if (run.reused) {
      run.artifactId = await env.artifacts.reuse(run.reused, p);
      return;
    }
    const { layers, config } = run.output!;
    run.artifactId = await env.artifacts.record(p, layers.map((l) => l.dir), config, run.srcDigest);
    run.count("final_artifact_stores");
    run.emit({ kind: "cache", phase: "finalize", cache_layer: "final_artifact", cache_outcome: "stored", cache_target: p.name, message: `artifact ${run.artifactId} stored`, level: "debug" });
  },
};
