// Build phase: the backend (native or buildkit) runs the steps over the source, and the artifact's config is made
// from the image config, the runtime defaults and the start/ready commands.

import type { ArtifactConfig } from "../artifact-config.ts";
import { BuildCancelled } from "../failure.ts";
import { BUILD_DEFAULTS, buildVm, dockerfileInput } from "../prepare.ts";
import type { BuilderPhase } from "./phase.ts";
import { BASE_USER } from "../base-template.ts";

export const buildPhase: BuilderPhase = {
  name: "build",
  applies: (run) => !run.reused,
  async run(run, env) {
    const { p, signal } = run;
    const req = p.request;
    const source = run.source!;
    // A Dockerfile on a Kiln template in plain instructions runs on Kiln's executor (prepare.ts decided).
    const native = p.backend === "native" || p.dockerfileExecutor?.kind === "native";
    const backend = native ? env.native : env.extensions!.buildkit!;
    const executor = p.dockerfileExecutor;
    if (executor?.kind === "native") run.emit({ kind: "message", phase: "step", message: `the Dockerfile's ${p.steps.length} instructions run as steps on template ${executor.from}'s layers, each cached like a declarative step`, total_steps: p.steps.length });
    else if (executor) run.emit({ kind: "message", phase: "preparing", message: `the Dockerfile goes to the Dockerfile builder (${executor.why}): no per-instruction cache` });
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
    if (executor?.kind === "native") {
      const why = executor.setsUser ? "the image's USER" : `the Dockerfile sets no USER, so machines keep the user of template ${executor.from}`;
      run.emit({ kind: "message", phase: "finalize", message: `machines from this template run as ${JSON.stringify(out.config.user ?? BASE_USER)} (${why})` });
    }
    run.emit({ kind: "message", phase: "finalize", message: "recording the artifact" });
    const layers = [...source.layers, ...out.layers];
    const image = { ...out.config, env: { ...out.config.env, ...(req.runtime_defaults?.envs ?? {}) } };
    if (req.runtime_defaults?.cwd) image.workingDir = req.runtime_defaults.cwd;
    if (req.runtime_defaults?.user) image.user = req.runtime_defaults.user;
    const config: ArtifactConfig = { image, layerDigests: layers.map((l) => l.digest), runtimeDefaults: req.runtime_defaults, startCmd: req.start_cmd, readyCmd: req.ready_cmd };
    run.output = { layers, config };
  },
};
