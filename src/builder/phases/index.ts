// The build pipeline's phases, in the order one loop runs them.

import type { BuilderPhase } from "./phase.ts";
import { contextPhase } from "./context.ts";
import { sourcePhase } from "./source.ts";
import { cachePhase } from "./cache.ts";
import { buildPhase } from "./build.ts";
import { startupPhase } from "./startup.ts";
import { finalizePhase } from "./finalize.ts";

export const BUILD_PIPELINE: readonly BuilderPhase[] = [contextPhase, sourcePhase, cachePhase, buildPhase, startupPhase, finalizePhase];
