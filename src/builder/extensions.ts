// Where other rooms plug into the builder: the OCI importer for `base_image`, its cache, and the buildkit backend.

import type { BuildRequestT } from "./request.ts";
import type { LogInput } from "./log.ts";
import type { ContextFile } from "./context.ts";
import type { BuildBackend, DockerfileInput } from "./backends/backend.ts";
import type { SourceLayers } from "./sources/source.ts";
import type { OciCacheRetention } from "./oci/cache-retention.ts";

/** Where another room plugs in: an OCI importer for `base_image`, a backend for Dockerfile builds. */
export interface BuildExtensions {
  /** `log`/`count` carry the import's progress and its `layer` cache entries into the build's log and summary. */
  ociImport?: (
    ref: string,
    opts: { auth?: BuildRequestT["base_image_auth"]; signal: AbortSignal; dataDir: string; log: (entry: LogInput) => void; count: (counter: string) => void },
  ) => Promise<SourceLayers & { digest: string }>;
  /** The importer's layer and blob cache, collected with the build output it serves. */
  ociCache?: OciCacheRetention;
  /** `validate` runs before the stream: what the Dockerfile's request gets wrong is an HTTP error, not a build. */
  buildkit?: BuildBackend & { validate?(input: DockerfileInput, context: ContextFile[]): void };
  /** KILN_BUILD_STEP_TIMEOUT_S and KILN_BUILD_TIMEOUT_S for native (step) builds, in ms. */
  nativeTimeouts?: { stepMs: number; buildMs: number };
}
