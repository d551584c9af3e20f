// Context phase: the uploaded context files the build uses, each a file_blob cache hit (prepare checked them).

import type { BuilderPhase } from "./phase.ts";

export const contextPhase: BuilderPhase = {
  name: "context",
  applies: () => true,
  async run(run) {
    for (const f of run.p.context) {
      run.count("file_blob_hits");
      run.emit({ kind: "cache", phase: "cache", cache_layer: "file_blob", cache_outcome: "hit", cache_target: f.path, message: `context file ${f.path} present`, level: "debug" });
    }
  },
};
