// A build's artifacts and tags: finding one built from the same input (the final-artifact cache), recording a new
// one, and moving the build's tags onto it (artifacts left with no tag start their retention clock).

import { existsSync } from "node:fs";
import type { ArtifactRow, Db } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import type { ArtifactConfig } from "./artifact-config.ts";
import { artifactConfig } from "./artifact-config.ts";
import { sha256 } from "./dockerfile.ts";
import type { PreparedBuild } from "./prepare.ts";
import { pointTags } from "../templates/tags.ts";

export interface ArtifactStore {
  /** An artifact built from the same input whose layers are all still on disk. */
  find(srcDigest: string): Promise<ArtifactRow | null>;
  /** Tags the found artifact for this build (its own template), or records a copy for another template. */
  reuse(a: ArtifactRow, p: PreparedBuild): Promise<string>;
  record(p: PreparedBuild, layers: string[], config: ArtifactConfig, srcDigest: string | null): Promise<string>;
}

export function createArtifactStore(deps: { db: Db; retentionS: number; contentDigest?: (dir: string) => Promise<string> }): ArtifactStore {
  const { db } = deps;

  /** An artifact built from the same input whose layers are all still on disk. */
  async function findArtifact(srcDigest: string) {
    const rows = await db.selectFrom("artifacts").selectAll().where("source_digest", "=", srcDigest).orderBy("created_at", "desc").execute();
    return rows.find((a) => (JSON.parse(a.layers_json) as string[]).every((d) => existsSync(d))) ?? null;
  }

  async function reuseArtifact(a: ArtifactRow, p: PreparedBuild): Promise<string> {
    if (a.template_id === p.template.id) {
      await moveTags(p, a.id);
      return a.id;
    }
    return recordArtifact(p, JSON.parse(a.layers_json) as string[], artifactConfig(a), a.source_digest ?? null);
  }

  async function recordArtifact(p: PreparedBuild, layers: string[], config: ArtifactConfig, srcDigest: string | null): Promise<string> {
    const id = newId("art");
    // On a shared store each layer's content digest goes with the artifact: other hosts fetch the layers by it.
    if (deps.contentDigest && !config.layerContent) {
      // Layers of the templates Kiln makes itself on every host (the base, in its cache) are each host's own.
      const builtIn = new Set((await db.selectFrom("artifacts").select("layers_json").where("build_id", "is", null).execute()).flatMap((a) => JSON.parse(a.layers_json) as string[]));
      const content: (string | null)[] = [];
      for (const dir of layers) content.push(builtIn.has(dir) ? null : await deps.contentDigest(dir));
      config = { ...config, layerContent: content };
    }
    const now = new Date().toISOString();
    const digest = sha256(JSON.stringify({ layers: config.layerDigests ?? layers, image: config.image, start: config.startCmd ?? null, ready: config.readyCmd ?? null }));
    await db.insertInto("artifacts").values({ id, template_id: p.template.id, build_id: p.buildId, layers_json: JSON.stringify(layers), digest, created_at: now, config_json: JSON.stringify(config), source_digest: srcDigest, retention_expires_at: null }).execute();
    await moveTags(p, id);
    return id;
  }

  /** Points the build's tags at the artifact; artifacts left with no tag start their retention clock. */
  function moveTags(p: PreparedBuild, artifactId: string) {
    return pointTags(db, { templateId: p.template.id, tags: p.tags, artifactId, retentionS: deps.retentionS });
  }

  return { find: findArtifact, reuse: reuseArtifact, record: recordArtifact };
}
