// What a template artifact carries besides its layers: the image config machines start with, the per-layer
// digests, and the start/ready commands a machine runs at create. Stored as JSON on the artifact row.

import type { ArtifactRow } from "../store/schema.ts";
import type { MachineCheckpoint } from "../runtime/driver.ts";
import type { ImageConfig } from "./sources/source.ts";

export interface ArtifactConfig {
  /** env, workingDir, user after the build with runtime_defaults applied; entrypoint/cmd recorded as found. */
  image: ImageConfig;
  /** One per entry of the artifact's layers, lowest first. */
  layerDigests?: string[];
  /**
   * On a store shared by hosts: each layer's content digest (src/hosts/layers/), by which a host lacking it fetches
   * it; null for a layer of a template every host makes itself (the base template), used at its path on each host.
   */
  layerContent?: (string | null)[];
  /** runtime_defaults as requested, kept for inspection. */
  runtimeDefaults?: { envs?: Record<string, string>; cwd?: string; user?: string };
  startCmd?: string;
  readyCmd?: string;
  /** gVisor: the build machine saved once start_cmd was ready; machines continue it instead of starting it. */
  checkpoint?: MachineCheckpoint;
  /**
   * Machines a hot pool boots ahead for this template are handed out with the default Python kernel started (unless
   * the template has a start_cmd). Set by the code-interpreter template's making (src/templates/code-interpreter.ts).
   */
  prestartKernel?: boolean;
}

export function artifactConfig(row: Pick<ArtifactRow, "config_json">): ArtifactConfig {
  if (!row.config_json) return { image: { env: {} } };
  return JSON.parse(row.config_json) as ArtifactConfig;
}
