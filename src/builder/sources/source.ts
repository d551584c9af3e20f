// The build-source seam: whatever a build starts from (a declarative base, a Kiln template, an imported OCI image,
// a Dockerfile build's result) becomes a stack of read-only layer directories plus the image config they run with.

/** What an image says about how its processes run; baked into a template artifact and applied at machine create. */
export interface ImageConfig {
  env: Record<string, string>;
  workingDir?: string;
  user?: string;
  /** Recorded from OCI images and Dockerfiles; machines start their agent, not this. */
  entrypoint?: string[];
  cmd?: string[];
}

/** Layer directories lowest first, each already in overlayfs form and shifted into the machines' uid range. */
export interface SourceLayers {
  layers: { dir: string; digest: string }[];
  config: ImageConfig;
}

/** A resolved build source: its layers and config, plus the digest that identifies it in cache keys. */
export interface BuildSource extends SourceLayers {
  /** SPEC.md source_type of the build this source serves. */
  type: "declarative" | "dockerfile" | "oci_import" | "template_base";
  /** Stable identity of the base (artifact digest, image manifest digest): the root of every cache key. */
  digest: string;
  /** Human-readable origin for the build log ("local/base", "docker.io/library/alpine:3"). */
  description: string;
}

export function emptyConfig(): ImageConfig {
  return { env: {} };
}
