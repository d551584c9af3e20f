// Logical templates as the API shows them: list, get (with tags, aliases and artifacts), delete, which refuses
// while machines use the template and leaves its layers to the retention collector, and tag moves by hand (E2B's
// assignTags/removeTags): a tag pointed at the artifact another tag names, or removed.

import type { Db, TemplateRow } from "../store/schema.ts";
import { KilnError } from "../errors.ts";
import { artifactConfig } from "../builder/artifact-config.ts";
import { BASE_TEMPLATE_REF, chooseTag, templateIdOf } from "./resolver.ts";
import { dropTags, pointTags } from "./tags.ts";

/** A tag as builds set them (src/builder/request.ts). */
const TAG = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;
/** Tags one call moves at most (as a build's `tags`). */
const MAX_TAGS = 64;
/** The tag E2B gives a template when none is named; removing it is refused, as E2B does. */
export const DEFAULT_TAG = "default";

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
  /**
   * Points `tags` at the artifact `target` names (`ref[:tag]`, a `tpl_` id or an alias; without a tag, the artifact
   * the ref means to a create). Refused for a name reserved by a `name_claim_token` (only its builds move its tags).
   */
  assignTags(target: string, tags: string[]): Promise<{ template: TemplateRow; artifactId: string; buildId: string | null; tags: string[] }>;
  /** Removes `tags` (never `default`) from the template `name` names; tags it lacks are ignored. */
  removeTags(name: string, tags: string[]): Promise<{ template: TemplateRow; removed: string[] }>;
}

/** `ref:tag` split at its last colon (a ref holds none); a `tpl_` id takes a tag the same way. */
function splitTag(target: string): { ref: string; tag: string | undefined } {
  const colon = target.lastIndexOf(":");
  return colon > 0 ? { ref: target.slice(0, colon), tag: target.slice(colon + 1) } : { ref: target, tag: undefined };
}

function checkedTags(tags: string[]): string[] {
  const unique = [...new Set(tags)];
  if (unique.length === 0) throw new KilnError("invalid_request", "At least one tag is required");
  if (unique.length > MAX_TAGS) throw new KilnError("invalid_request", `At most ${MAX_TAGS} tags at once`);
  for (const t of unique) if (!TAG.test(t)) throw new KilnError("invalid_request", `Invalid tag ${JSON.stringify(t)}: 1 to 128 letters, digits, '.', '_' and '-', starting with a letter or digit`);
  return unique;
}

export function createTemplateCatalog(deps: { db: Db; retentionS: number }): TemplateCatalog {
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

  /** The template a tag move names; a name reserved by a claim token moves its tags only through its builds. */
  async function forTagMove(ref: string): Promise<TemplateRow> {
    const t = await load(ref);
    if (t.name_claim_hash) throw new KilnError("conflict", `The name ${t.canonical_ref} is reserved by a name_claim_token: its tags move only by building it with that token`);
    return t;
  }

  async function assignTags(target: string, tags: string[]) {
    const { ref, tag } = splitTag(target);
    if (tag !== undefined && !TAG.test(tag)) throw new KilnError("invalid_request", `Invalid target ${JSON.stringify(target)}: its tag ${JSON.stringify(tag)} is not a tag`);
    const wanted = checkedTags(tags);
    const t = await forTagMove(ref);
    const tagged = await db.selectFrom("artifact_tags").select(["tag", "artifact_id"]).where("template_id", "=", t.id).execute();
    const chosen = chooseTag(tag, tagged.map((r) => r.tag));
    const artifactId = tagged.find((r) => r.tag === chosen)?.artifact_id;
    if (!artifactId) throw new KilnError("not_found", tag === undefined ? `Template ${t.canonical_ref} has no default tag: name the tag to copy, as ${ref}:<tag>` : `Template ${t.canonical_ref} has no tag ${JSON.stringify(tag)}`);
    await pointTags(db, { templateId: t.id, tags: wanted, artifactId, retentionS: deps.retentionS });
    const artifact = await db.selectFrom("artifacts").select("build_id").where("id", "=", artifactId).executeTakeFirstOrThrow();
    return { template: t, artifactId, buildId: artifact.build_id, tags: wanted };
  }

  async function removeTags(name: string, tags: string[]) {
    if (splitTag(name).tag !== undefined) throw new KilnError("invalid_request", "Template name should not contain a tag, use the 'tags' field instead");
    const unwanted = checkedTags(tags);
    if (unwanted.includes(DEFAULT_TAG)) throw new KilnError("invalid_request", `Cannot delete the '${DEFAULT_TAG}' tag`);
    const t = await forTagMove(name);
    return { template: t, removed: await dropTags(db, { templateId: t.id, tags: unwanted, retentionS: deps.retentionS }) };
  }

  return { list, get, remove, assignTags, removeTags };
}
