// The snapshot source: `from_snapshot` builds on a machine's snapshot, so an agent's prepared machine becomes a
// template. Its template's layers stay below; the files its machine wrote (the snapshot's writable layer) become
// one more read-only layer on top. A memory snapshot's processes are not carried: a template holds files only.

import { join } from "node:path";
import { createHash } from "node:crypto";
import { newId } from "../../store/ids.ts";
import type { LayerCache } from "../cache/layers.ts";
import type { LogInput } from "../log.ts";
import type { BuildSource } from "./source.ts";

/** What the builder needs from the snapshots room (src/snapshots/). */
export interface SnapshotBases {
  /** The snapshot's template artifact; a KilnError (404 unknown, 409 deleted or on another host) when it cannot be a base. */
  buildBase(id: string): Promise<{ id: string; artifactId: string; memory: boolean }>;
  /** Copies the files its machine wrote to `destDir` as a template layer, holding the snapshot meanwhile. */
  copyLayer(id: string, destDir: string): Promise<void>;
}

/** A snapshot's files never change: one key per snapshot (and base), so rebuilds from it reuse the copied layer. */
export function snapshotLayerKey(snapshotId: string, baseDigest: string): string {
  return `sha256:${createHash("sha256").update(`snapshot\0${snapshotId}\0${baseDigest}`).digest("hex")}`;
}

/** The template source of the snapshot's artifact with the snapshot's files as its highest layer. */
export async function snapshotSource(
  base: BuildSource,
  snapshot: { id: string; memory: boolean },
  deps: { snapshots: SnapshotBases; layerCache: LayerCache; layersDir: string; emit(e: LogInput): void; count(c: string): void },
): Promise<BuildSource> {
  const key = snapshotLayerKey(snapshot.id, base.digest);
  const target = `files of snapshot ${snapshot.id}`;
  if (snapshot.memory) {
    deps.emit({ kind: "warning", level: "warn", phase: "preparing", message: `snapshot ${snapshot.id} also saved its machine's processes: a template keeps only its files, so machines of this template start their processes afresh` });
  }
  const cached = await deps.layerCache.lookup(key);
  let dir = cached?.dir ?? null;
  deps.count(dir ? "layer_hits" : "layer_misses");
  if (dir) {
    deps.emit({ kind: "cache", phase: "cache", cache_layer: "layer", cache_outcome: "hit", cache_target: target, message: `cache hit: ${target}` });
  } else {
    deps.emit({ kind: "message", phase: "preparing", message: `copying the files of snapshot ${snapshot.id}` });
    dir = join(deps.layersDir, `${key.slice("sha256:".length, "sha256:".length + 20)}-${newId("bld").slice(-8)}`);
    await deps.snapshots.copyLayer(snapshot.id, dir);
    await deps.layerCache.store(key, dir);
    deps.count("layer_stores");
    deps.emit({ kind: "cache", phase: "cache", cache_layer: "layer", cache_outcome: "stored", cache_target: target, message: `cached: ${target}`, level: "debug" });
  }
  return { ...base, digest: key, description: `snapshot ${snapshot.id} of ${base.description}`, layers: [...base.layers, { dir, digest: key }] };
}
