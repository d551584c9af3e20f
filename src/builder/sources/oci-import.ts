// The `oci_import` build source: a `base_image` pulled from its registry into layer dirs, shaped to plug into the
// build pipeline's extension point (`ociImport`) with the import's progress going to the build log and counters.

import { join } from "node:path";
import { importImage } from "../oci/import.ts";
import { importLogEvents } from "../oci/events.ts";
import type { ImportLogEntry } from "../oci/events.ts";
import type { BaseImageAuth } from "../oci/auth.ts";
import type { SourceLayers } from "../oci/types.ts";

export interface OciImportSourceDeps {
  /** KILN_CACHE_DIR: layers go to `<cacheDir>/oci`. */
  cacheDir: string;
  /** KILN_INSECURE_REGISTRIES. */
  insecureRegistries: string[];
}

export interface OciImportCall {
  auth?: BaseImageAuth;
  signal: AbortSignal;
  /** The build's log sink and cache counters; an import without them runs silently. */
  log?: (entry: ImportLogEntry) => void;
  count?: (counter: string) => void;
}

export function createOciImportSource(deps: OciImportSourceDeps) {
  return async function ociImport(ref: string, call: OciImportCall): Promise<SourceLayers & { digest: string }> {
    const events = call.log && call.count ? importLogEvents(call.log, call.count) : {};
    const image = await importImage(ref, { cacheDir: join(deps.cacheDir, "oci"), auth: call.auth, insecureRegistries: deps.insecureRegistries, signal: call.signal, ...events });
    return { layers: image.layers, config: image.config, digest: image.digest };
  };
}
