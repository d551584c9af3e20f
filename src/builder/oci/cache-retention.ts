// Retention of the importer's cache (`<KILN_CACHE_DIR>/oci`): unpacked layer dirs no artifact names, image configs
// and leftover downloads go once nothing has used them for the retention period. An import marks what it uses
// (pins while it runs; the mtime of a layer dir or blob is its last use), so a running import or build keeps all
// it needs.

import { renameSync } from "node:fs";
import { readdir, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import { isPinned, sweepAbandoned } from "./import.ts";

export interface OciCacheCollection {
  /** Layer dirs an artifact still names: never removed. */
  keep: Set<string>;
  /** Anything last used before this (ms since the epoch) is past retention. */
  staleBefore: number;
  /** When the oldest running build was queued: what was used since may be needed by it. */
  runningSince?: number;
}

export function createOciCacheRetention(ociCacheDir: string) {
  let seq = 0;

  /** Removes one cache path unless an import in this process pins it: renamed aside first, in the same tick as the check. */
  async function remove(path: string): Promise<boolean> {
    if (isPinned(path) || isPinned(path.replace(/\.partial$/, ""))) return false;
    const aside = `${path}.gc-${process.pid}-${++seq}`;
    try {
      renameSync(path, aside);
    } catch {
      return false;
    }
    await rm(aside, { recursive: true, force: true });
    return true;
  }

  function stale(mtimeMs: number, c: OciCacheCollection): boolean {
    return mtimeMs < c.staleBefore && (c.runningSince === undefined || mtimeMs < c.runningSince);
  }

  async function collect(c: OciCacheCollection): Promise<{ layers: number; blobs: number }> {
    const layersDir = join(ociCacheDir, "layers");
    await sweepAbandoned(layersDir);
    let layers = 0;
    for (const name of await readdir(layersDir).catch(() => [] as string[])) {
      const dir = join(layersDir, name);
      if (/\.gc-\d+-\d+$/.test(name)) {
        await rm(dir, { recursive: true, force: true }); // a collection that stopped half-way
        continue;
      }
      if (/\.tmp-\d+-/.test(name) || c.keep.has(dir)) continue;
      const st = await stat(dir).catch(() => undefined);
      if (st && stale(st.mtimeMs, c) && (await remove(dir))) layers++;
    }
    let blobs = 0;
    const blobsDir = join(ociCacheDir, "blobs", "sha256");
    for (const name of await readdir(blobsDir).catch(() => [] as string[])) {
      const path = join(blobsDir, name);
      const st = await stat(path).catch(() => undefined);
      if (st && stale(st.mtimeMs, c) && (await remove(path))) blobs++;
    }
    return { layers, blobs };
  }

  return { collect };
}

export type OciCacheRetention = ReturnType<typeof createOciCacheRetention>;
