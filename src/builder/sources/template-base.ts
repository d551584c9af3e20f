// The template_base source: a build FROM a Kiln template starts on that artifact's layers and image config.

import type { ResolvedTemplate } from "../../templates/service.ts";
import type { BuildSource } from "./source.ts";
import { artifactConfig } from "../artifact-config.ts";

export function templateBaseSource(resolved: ResolvedTemplate, type: BuildSource["type"] = "template_base"): BuildSource {
  const config = artifactConfig(resolved.artifact);
  const digests = layerDigests(resolved);
  return {
    type,
    digest: resolved.artifact.digest,
    description: `${resolved.template.canonical_ref} (${resolved.artifact.id})`,
    layers: resolved.layers.map((dir, i) => ({ dir, digest: digests[i] })),
    config: config.image,
  };
}

/** Per-layer digests the artifact recorded; a pre-build artifact (the base) has only its own digest. */
function layerDigests(resolved: ResolvedTemplate): string[] {
  const recorded = artifactConfig(resolved.artifact).layerDigests;
  if (recorded && recorded.length === resolved.layers.length) return recorded;
  return resolved.layers.map((_dir, i) => `${resolved.artifact.digest}#${i}`);
}
