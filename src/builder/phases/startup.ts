// Startup phase: a template with a start command has it held to its readiness check once, in a build machine on
// the new layers (start-command.ts); under gVisor the ready machine's checkpoint is kept beside the layers.

import { join } from "node:path";
import { BuildCancelled } from "../failure.ts";
import { buildVm } from "../prepare.ts";
import { verifyStartCommand } from "../start-command.ts";
import type { BuilderPhase } from "./phase.ts";

export const startupPhase: BuilderPhase = {
  name: "startup",
  applies: (run) => !run.reused && Boolean(run.output?.config.startCmd),
  async run(run, env) {
    const { p, signal } = run;
    const { layers, config } = run.output!;
    // Kept beside the layers and removed by retention with the artifact that names it.
    const checkpointDir = join(env.layersDir, `checkpoint-${p.buildId}`);
    config.checkpoint = await verifyStartCommand({ driver: env.driver, layers: layers.map((l) => l.dir), config, vm: buildVm(p.request), log: (e) => run.emit(e), checkpointDir });
    if (signal.aborted) throw new BuildCancelled();
  },
};
