// The bounds on what an image may make Kiln read, hold and write — each a KILN_OCI_* setting (src/config.ts) — and
// the running count of uncompressed bytes an import has unpacked, shared by its parallel layers.

import { importError } from "./types.ts";

export interface ImportLimits {
  /** A manifest or index as fetched. */
  manifestBytes: number;
  /** The image config blob (declared and as served). */
  configBytes: number;
  /** One file in a layer. */
  entryBytes: number;
  /** Uncompressed tar bytes of every layer one import unpacks (gzip and zstd bombs stop here). */
  imageBytes: number;
  /** Layers in one image: below MAX_LAYERS (src/builder/backends/native.ts) less Kiln's own top layer. */
  layers: number;
  /** Entries in one layer (files, dirs, links, whiteouts): bounds the inodes and the memory one layer costs. */
  layerEntries: number;
}

export const DEFAULT_IMPORT_LIMITS: ImportLimits = {
  manifestBytes: 4 << 20,
  configBytes: 8 << 20,
  entryBytes: 8 * 2 ** 30,
  imageBytes: 32 * 2 ** 30,
  layers: 39,
  layerEntries: 1_000_000,
};

/** Each limit's setting, named in the build_error that hits it. */
export const LIMIT_SETTINGS: Record<keyof ImportLimits, string> = {
  manifestBytes: "KILN_OCI_MAX_MANIFEST_BYTES",
  configBytes: "KILN_OCI_MAX_CONFIG_BYTES",
  entryBytes: "KILN_OCI_MAX_ENTRY_BYTES",
  imageBytes: "KILN_OCI_MAX_IMAGE_BYTES",
  layers: "KILN_OCI_MAX_LAYERS",
  layerEntries: "KILN_OCI_MAX_LAYER_ENTRIES",
};

/** The build_error for something over its limit: what, how much, and the setting that allows more. */
export function overLimit(what: string, limits: ImportLimits, key: keyof ImportLimits): Error {
  const n = limits[key];
  const amount = key === "layers" || key === "layerEntries" ? `${n}` : bytes(n);
  return importError(`${what} exceeds ${amount} (${LIMIT_SETTINGS[key]})`);
}

/** Uncompressed bytes an import may still unpack. */
export class ByteBudget {
  private used = 0;
  private readonly limits: ImportLimits;
  constructor(limits: ImportLimits) {
    this.limits = limits;
  }

  take(n: number): void {
    this.used += n;
    if (this.used > this.limits.imageBytes) throw overLimit("the image's uncompressed size", this.limits, "imageBytes");
  }
}

export function bytes(n: number): string {
  if (n >= 2 ** 30 && n % 2 ** 30 === 0) return `${n / 2 ** 30} GiB`;
  if (n >= 2 ** 20 && n % 2 ** 20 === 0) return `${n / 2 ** 20} MiB`;
  return `${n} bytes`;
}
