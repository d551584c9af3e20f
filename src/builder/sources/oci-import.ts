// The `oci_import` build source: a `base_image` pulled from its registry into layer dirs, shaped to plug into the
// build pipeline's extension point (`ociImport`) with the import's progress going to the build log and counters.

import { join } from "node:path";
import { importImage } from "../oci/import.ts";
import { importLogEvents } from "../oci/events.ts";
import type { ImportLogEntry } from "../oci/events.ts";
import type { BaseImageAuth } from "../oci/auth.ts";
import type { ImportLimits } from "../oci/limits.ts";
import type { SourceLayers } from "../oci/types.ts";
import { stackFits } from "../backends/native.ts";

export interface OciImportSourceDeps {
  /** The importer's own cache, `$KILN_DATA_DIR/oci` (blobs/, layers/): it lives and is collected with the store. */
  ociDir: string;
  /** KILN_INSECURE_REGISTRIES. */
  insecureRegistries: string[];
  /** KILN_OCI_MAX_*; the defaults when not given. */
  limits?: ImportLimits;
}

export interface OciImportCall {
  auth?: BaseImageAuth;
  signal: AbortSignal;
  /** KILN_DATA_DIR: machines are made under it, which decides how many layer paths fit in one overlayfs mount. */
  dataDir?: string;
  /** The build's log sink and cache counters; an import without them runs silently. */
  log?: (entry: ImportLogEntry) => void;
  count?: (counter: string) => void;
}

export function createOciImportSource(deps: OciImportSourceDeps) {
  return async function ociImport(ref: string, call: OciImportCall): Promise<SourceLayers & { digest: string }> {
    const events = call.log && call.count ? importLogEvents(call.log, call.count) : {};
    // The image's layers plus Kiln's top layer must mount as one machine root: refused before any download if not.
    const fits = call.dataDir ? (dirs: string[]) => stackFits([...dirs, join(deps.ociDir, "layers", `kiln-${"0".repeat(64)}`)], 0, join(call.dataDir!, "layers")) : undefined;
    const image = await importImage(ref, { cacheDir: deps.ociDir, auth: call.auth, insecureRegistries: deps.insecureRegistries, signal: call.signal, limits: deps.limits, fits, ...events });
    return { layers: image.layers, config: image.config, digest: image.digest };
  };
}
