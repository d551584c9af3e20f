// The shape every build phase has, and the one loop that runs them. A phase reads what earlier phases left on the
// run (the source, its digest, a reused artifact, the backend's output) and adds its own; e2b-dev/infra's
// BuilderPhase is the model.

import type { ArtifactRow, Db } from "../../store/schema.ts";
import type { MachineDriver } from "../../runtime/driver.ts";
import type { ArtifactConfig } from "../artifact-config.ts";
import type { ArtifactStore } from "../artifacts.ts";
import type { BuildBackend } from "../backends/backend.ts";
import type { BuildExtensions } from "../extensions.ts";
import type { BuildLogs, LogInput } from "../log.ts";
import type { PreparedBuild } from "../prepare.ts";
import type { BuildSource } from "../sources/source.ts";
import type { SnapshotBases } from "../sources/snapshot.ts";
import type { LayerCache } from "../cache/layers.ts";

/** One build in flight, as the phases see it and fill it in. */
export interface BuildRun {
  readonly p: PreparedBuild;
  readonly signal: AbortSignal;
  /** Appends an entry to the build's log (its phase becomes the build's current phase). */
  emit(e: LogInput): void;
  /** Counts one cache outcome in the build's cache_summary. */
  count(counter: string): void;
  /** The source the layers stack on (set by the source phase). */
  source?: BuildSource;
  /** The cache identity of the whole build's input (set by the source phase). */
  srcDigest: string | null;
  /** An artifact already built from the same input (set by the cache phase). */
  reused: ArtifactRow | null;
  /** The built layers and the config the artifact records (set by the build phase). */
  output?: { layers: { dir: string; digest: string }[]; config: ArtifactConfig };
  /** The artifact the build's tags point at (set by the finalize phase). */
  artifactId?: string;
}

/** What the phases use from the server. */
export interface PhaseEnv {
  db: Db;
  driver: MachineDriver;
  dataDir: string;
  layersDir: string;
  native: BuildBackend;
  extensions?: BuildExtensions;
  artifacts: ArtifactStore;
  logs: BuildLogs;
  /** The step-layer cache (a snapshot's copied files are kept in it too). */
  layerCache: LayerCache;
  /** Snapshots to build on (from_snapshot); absent where the server keeps none. */
  snapshots?: SnapshotBases;
}

export interface BuilderPhase {
  readonly name: string;
  /** Whether the phase has work in this build (a reused artifact skips the backend and the start check). */
  applies(run: BuildRun): boolean;
  run(run: BuildRun, env: PhaseEnv): Promise<void>;
}

/** Runs the phases in order; a phase that throws ends the build (failure.ts decides how). */
export async function runPhases(phases: readonly BuilderPhase[], run: BuildRun, env: PhaseEnv): Promise<void> {
  for (const phase of phases) {
    if (phase.applies(run)) await phase.run(run, env);
  }
}
