// Build phase: the backend (native or buildkit) runs the steps over the source, and the artifact's config is made
// from the image config, the runtime defaults and the start/ready commands.

import type { ArtifactConfig } from "../artifact-config.ts";
import { BuildCancelled } from "../failure.ts";
import { BUILD_DEFAULTS, buildVm, dockerfileInput } from "../prepare.ts";
import type { BuilderPhase } from "./phase.ts";

export const buildPhase: BuilderPhase = {
  name: "build",
  applies: (run) => !run.reused,
  async run(run, env) {
    const { p, signal } = run;
    const req = p.request;
    const source = run.source!;
    const backend = p.backend === "native" ? env.native : env.extensions!.buildkit!;
    const out = await backend.run({
      buildId: p.buildId,
      source,
      steps: p.steps,
      context: p.context,
      dockerfile: dockerfileInput(req),
      buildEnvs: req.build_envs ?? {},
      vm: buildVm(req),
      skipCache: req.skip_cache === true,
      maxAttempts: BUILD_DEFAULTS.maxAttempts,
      signal,
      log: (e) => run.emit(e),
      count: (c) => run.count(c),
      logBackpressure: () => env.logs.backpressure(p.buildId),
    });
    if (signal.aborted) throw new BuildCancelled();
    run.emit({ kind: "message", phase: "finalize", message: "recording the artifact" });
    const layers = [...source.layers, ...out.layers];
    const image = { ...out.config, env: { ...out.config.env, ...(req.runtime_defaults?.envs ?? {}) } };
    if (req.runtime_defaults?.cwd) image.workingDir = req.runtime_defaults.cwd;
    if (req.runtime_defaults?.user) image.user = req.runtime_defaults.user;
    const config: ArtifactConfig = { image, layerDigests: layers.map((l) => l.digest), runtimeDefaults: req.runtime_defaults, startCmd: req.start_cmd, readyCmd: req.ready_cmd };
    run.output = { layers, config };
  },
};
