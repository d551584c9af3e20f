// The `layer` tier: step cache key → layer directory under $KILN_DATA_DIR/layers, in the store so it survives
// restarts. An entry whose directory has gone (collected) is a miss.

import { existsSync } from "node:fs";
import type { Db } from "../../store/schema.ts";

export function createLayerCache(db: Db) {
  async function lookup(key: string): Promise<{ dir: string | null } | null> {
    const row = await db.selectFrom("build_cache").selectAll().where("key", "=", key).executeTakeFirst();
    if (!row) return null;
    if (row.layer_dir !== null && !existsSync(row.layer_dir)) return null;
    await db.updateTable("build_cache").set({ last_used_at: new Date().toISOString() }).where("key", "=", key).execute();
    return { dir: row.layer_dir };
  }

  async function store(key: string, dir: string | null): Promise<void> {
    const now = new Date().toISOString();
    const existing = await db.selectFrom("build_cache").select("key").where("key", "=", key).executeTakeFirst();
    if (existing) await db.updateTable("build_cache").set({ layer_dir: dir, last_used_at: now }).where("key", "=", key).execute();
    else await db.insertInto("build_cache").values({ key, layer_dir: dir, created_at: now, last_used_at: now }).execute();
  }

  return { lookup, store };
}

export type LayerCache = ReturnType<typeof createLayerCache>;
