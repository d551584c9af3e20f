// What an image source hands the build pipeline (the `SourceLayers` seam of src/builder/sources), the media types
// the importer understands, and the one way an import fails: a `build_error` that names what and why.

import { KilnError } from "../../errors.ts";

export type { ImageConfig, SourceLayers } from "../sources/source.ts";

export const MEDIA = {
  ociIndex: "application/vnd.oci.image.index.v1+json",
  ociManifest: "application/vnd.oci.image.manifest.v1+json",
  dockerList: "application/vnd.docker.distribution.manifest.list.v2+json",
  dockerManifest: "application/vnd.docker.distribution.manifest.v2+json",
} as const;

export const MANIFEST_ACCEPT = [MEDIA.ociIndex, MEDIA.ociManifest, MEDIA.dockerList, MEDIA.dockerManifest].join(", ");

export type LayerCompression = "none" | "gzip" | "zstd";

/** The compression of a layer blob from its media type; anything else (foreign or encrypted layers) is refused. */
export function layerCompression(mediaType: string): LayerCompression | undefined {
  switch (mediaType) {
    case "application/vnd.oci.image.layer.v1.tar":
    case "application/vnd.docker.image.rootfs.diff.tar":
      return "none";
    case "application/vnd.oci.image.layer.v1.tar+gzip":
    case "application/vnd.docker.image.rootfs.diff.tar.gzip":
      return "gzip";
    case "application/vnd.oci.image.layer.v1.tar+zstd":
      return "zstd";
    default:
      return undefined;
  }
}

/** Progress of an import: lines the pipeline turns into SSE `message` entries, and per-layer cache outcomes. */
export interface ImportEvents {
  onMessage?: (line: string) => void;
  onLayer?: (layer: { digest: string; outcome: "hit" | "miss" | "stored"; bytes: number }) => void;
}

/** A failed import, phrased for the user: it becomes the build's terminal `build_error` entry. */
export function importError(message: string, details?: Record<string, unknown>): KilnError {
  return new KilnError("build_rejected", message, { detail: { code: "build_error", phase: "preparing", message, ...(details ? { details } : {}) } });
}

/**
 * A digest Kiln can check and may use in a path or URL: `sha256:` and 64 lowercase hex digits, nothing else. Every
 * digest a manifest, index, config or OCI layout names passes here before anything is fetched, read or written.
 */
export function checkDigest(digest: unknown, what: string): string {
  if (typeof digest !== "string" || !/^sha256:[a-f0-9]{64}$/.test(digest)) {
    throw importError(`${what} has a digest Kiln cannot check (${JSON.stringify(String(digest).slice(0, 100))}); only sha256 digests are supported`);
  }
  return digest;
}
