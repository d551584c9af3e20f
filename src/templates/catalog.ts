// Logical templates as the API shows them: list, get (with tags, aliases and artifacts) and delete, which refuses
// while machines use the template and leaves its layers to the retention collector.

import type { Db, TemplateRow } from "../store/schema.ts";
import { KilnError } from "../errors.ts";
import { artifactConfig } from "../builder/artifact-config.ts";
import { BASE_TEMPLATE_REF, templateIdOf } from "./resolver.ts";

/** A logical template as the API shows it: its tags, aliases and latest artifacts. */
export type TemplateView = {
  template_id: string;
  namespace: string;
  name: string;
  canonical_ref: string;
  aliases: string[];
  tags: Record<string, string>;
  artifacts: {
    artifact_id: string;
    build_id: string | null;
    digest: string;
    tags: string[];
    layers: number;
    env: string[];
    cwd: string | null;
    user: string | null;
    start_cmd: string | null;
    created_at: string;
    retention_expires_at: string | null;
  }[];
  created_at: string;
  updated_at: string;
};

export interface TemplateCatalog {
  list(): Promise<{ templates: TemplateView[] }>;
  get(id: string): Promise<TemplateView>;
  /** Refuses while machines use the template or a build of it runs; its layers are left to retention. */
  remove(id: string): Promise<TemplateView>;
}

export function createTemplateCatalog(deps: { db: Db }): TemplateCatalog {
  const { db } = deps;

  async function view(t: TemplateRow) {
    const tags = await db.selectFrom("artifact_tags").select(["tag", "artifact_id"]).where("template_id", "=", t.id).orderBy("tag").execute();
    const aliases = await db.selectFrom("template_aliases").select("alias_ref").where("template_id", "=", t.id).orderBy("alias_ref").execute();
    const artifacts = await db.selectFrom("artifacts").selectAll().where("template_id", "=", t.id).orderBy("created_at", "desc").limit(20).execute();
    return {
      template_id: t.id,
      namespace: t.namespace,
      name: t.name,
      canonical_ref: t.canonical_ref,
      aliases: aliases.map((a) => a.alias_ref),
      tags: Object.fromEntries(tags.map((r) => [r.tag, r.artifact_id])) as Record<string, string>,
      artifacts: artifacts.map((a) => {
        const c = artifactConfig(a);
        return {
          artifact_id: a.id,
          build_id: a.build_id,
          digest: a.digest,
          tags: tags.filter((r) => r.artifact_id === a.id).map((r) => r.tag),
          layers: (JSON.parse(a.layers_json) as string[]).length,
          env: Object.keys(c.image.env).sort(),
          cwd: c.image.workingDir ?? null,
          user: c.image.user ?? null,
          start_cmd: c.startCmd ?? null,
          created_at: a.created_at,
          retention_expires_at: a.retention_expires_at ?? null,
        };
      }),
      created_at: t.created_at,
      updated_at: t.updated_at,
    };
  }

  async function list() {
    const rows = await db.selectFrom("templates").selectAll().orderBy("canonical_ref").execute();
    return { templates: await Promise.all(rows.map(view)) };
  }

  async function load(id: string): Promise<TemplateRow> {
    const templateId = await templateIdOf(db, id);
    return db.selectFrom("templates").selectAll().where("id", "=", templateId).executeTakeFirstOrThrow();
  }

  async function get(id: string) {
    return view(await load(id));
  }

  async function remove(id: string) {
    const t = await load(id);
    if (t.canonical_ref === BASE_TEMPLATE_REF) throw new KilnError("conflict", `${BASE_TEMPLATE_REF} is Kiln's own base template and cannot be deleted`);
    const used = await db.selectFrom("machines").select("id").where("template_id", "=", t.id).where("status", "in", ["creating", "running", "hibernated"]).execute();
    if (used.length > 0) throw new KilnError("conflict", `${t.canonical_ref} is used by ${used.length} machine(s): ${used.slice(0, 5).map((m) => m.id).join(", ")}`);
    const snapshot = await db.selectFrom("snapshots").select("id").where("template_id", "=", t.id).where("status", "in", ["creating", "ready"]).executeTakeFirst();
    if (snapshot) throw new KilnError("conflict", `${t.canonical_ref} is the template of snapshot ${snapshot.id}: delete its snapshots first`);
    const running = await db.selectFrom("builds").select("id").where("template_id", "=", t.id).where("status", "in", ["waiting", "building"]).executeTakeFirst();
    if (running) throw new KilnError("conflict", `${t.canonical_ref} has a build running (${running.id}); cancel it first`);
    const shown = await view(t);
    await db.transaction().execute(async (tx) => {
      // A subquery, not a list of ids: a long history would pass the store's bound-variable limit (SQLite 32,766).
      const buildIds = tx.selectFrom("builds").select("id").where("template_id", "=", t.id);
      await tx.deleteFrom("build_logs").where("build_id", "in", buildIds).execute();
      await tx.deleteFrom("builds").where("template_id", "=", t.id).execute();
      await tx.deleteFrom("artifact_tags").where("template_id", "=", t.id).execute();
      await tx.deleteFrom("template_aliases").where("template_id", "=", t.id).execute();
      await tx.deleteFrom("artifacts").where("template_id", "=", t.id).execute();
      await tx.deleteFrom("templates").where("id", "=", t.id).execute();
    });
    return shown;
  }

  return { list, get, remove };
}
