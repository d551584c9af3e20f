// Retention of template build output: artifacts no tag points at expire after the retention period and are removed
// once no machine uses them; then layer directories no artifact or cache entry needs go, so rebuilds stay bounded.

import { readdir, rm, stat } from "node:fs/promises";
import { dirname, join } from "node:path";
import type { Db } from "../store/schema.ts";
import { artifactConfig } from "./artifact-config.ts";
import type { OciCacheRetention } from "./oci/cache-retention.ts";
import type { BlobStore } from "./context.ts";

/** This host's layer holdings on a shared store (src/hosts/layers/): fetched copies are kept while an artifact needs them. */
export interface HeldLayers {
  ownHoldings(): Promise<{ digest: string; dir: string }[]>;
  forget(dir: string): Promise<void>;
}

export function createBuildRetention(deps: { db: Db; layersDir: string; retentionS: number; buildsRunning: () => boolean; ociCache?: OciCacheRetention; held?: HeldLayers; blobs?: Pick<BlobStore, "collect"> }) {
  const { db, layersDir } = deps;

  /**
   * Removes artifacts past retention that no machine uses, then layer directories no artifact, cache entry of a live
   * artifact or running build needs. Layers only the cache knows about go once they have not been used for the
   * retention period, so rebuilds never grow disk use without bound.
   */
  async function collect(now = new Date()): Promise<{ artifacts: number; layers: number; ociLayers: number; ociBlobs: number; contextBlobs: number }> {
    const iso = now.toISOString();
    const expired = await db.selectFrom("artifacts").select("id").where("retention_expires_at", "is not", null).where("retention_expires_at", "<=", iso).execute();
    let artifacts = 0;
    for (const { id } of expired) {
      const inUse = await db.selectFrom("machines").select("id").where("artifact_id", "=", id).where("status", "in", ["creating", "running", "hibernated"]).executeTakeFirst();
      const tagged = await db.selectFrom("artifact_tags").select("tag").where("artifact_id", "=", id).executeTakeFirst();
      // A snapshot's disk lies over its artifact's layers (room: snapshots): kept while the snapshot is.
      const snapshotted = await db.selectFrom("snapshots").select("id").where("artifact_id", "=", id).where("status", "in", ["creating", "ready"]).executeTakeFirst();
      if (inUse || tagged || snapshotted) continue;
      await db.deleteFrom("artifacts").where("id", "=", id).execute();
      artifacts++;
    }
    const staleBefore = new Date(now.getTime() - deps.retentionS * 1000).toISOString();
    await db.deleteFrom("build_cache").where("last_used_at", "<", staleBefore).execute();
    const keep = new Set<string>();
    const content = new Set<string>();
    for (const a of await db.selectFrom("artifacts").select(["layers_json", "config_json"]).execute()) {
      for (const d of JSON.parse(a.layers_json) as string[]) keep.add(d);
      const config = artifactConfig(a);
      for (const d of config.layerContent ?? []) if (d) content.add(d);
      if (config.checkpoint) keep.add(dirname(config.checkpoint.imageDir));
    }
    // A layer this host fetched (or holds under another path) stays while a live artifact names its content.
    for (const h of (await deps.held?.ownHoldings()) ?? []) if (content.has(h.digest)) keep.add(h.dir);
    for (const c of await db.selectFrom("build_cache").select("layer_dir").execute()) if (c.layer_dir) keep.add(c.layer_dir);
    let layers = 0;
    const entries = await readdir(layersDir).catch(() => [] as string[]);
    for (const name of entries) {
      const dir = join(layersDir, name);
      if (keep.has(dir)) continue;
      // A layer being captured right now has no record yet: leave anything young alone while builds run.
      const st = await stat(dir).catch(() => null);
      if (!st || (deps.buildsRunning() && now.getTime() - st.mtimeMs < 3600_000)) continue;
      await db.deleteFrom("build_cache").where("layer_dir", "=", dir).execute();
      await rm(dir, { recursive: true, force: true });
      await deps.held?.forget(dir);
      layers++;
    }
    // The image importer's cache: what no artifact names and nothing used since the oldest running build began.
    const running = await db.selectFrom("builds").select((eb) => eb.fn.min("queued_at").as("since")).where("status", "in", ["waiting", "building"]).executeTakeFirst();
    const runningSince = running?.since ? Date.parse(String(running.since)) : undefined;
    const oci = deps.ociCache ? await deps.ociCache.collect({ keep, staleBefore: Date.parse(staleBefore), runningSince }) : { layers: 0, blobs: 0 };
    // Build context blobs ($DATA/blobs): what no build used (or was asked about) for the retention period.
    const contextBlobs = (await deps.blobs?.collect({ staleBefore: Date.parse(staleBefore), runningSince })) ?? 0;
    return { artifacts, layers, ociLayers: oci.layers, ociBlobs: oci.blobs, contextBlobs };
  }

  return { collect };
}
