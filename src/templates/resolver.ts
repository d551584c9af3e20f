// The one template-reference resolver: what `ns/name:tag`, `name`, an alias, a `tpl_` or an `art_` id names. Machines,
// builds, the catalog and deployments all resolve through here, so a reference means the same thing everywhere.

import type { Db, TemplateRow } from "../store/schema.ts";
import { KilnError } from "../errors.ts";

export const DEFAULT_NAMESPACE = "local";
export const BASE_TEMPLATE_REF = "local/base";

/** Splits `ns/name:tag`, `name:tag`, `name` into canonical ref and tag (`tag` undefined when the ref names none). */
export function parseTemplateRef(ref: string): { canonicalRef: string; tag: string | undefined } {
  const m = /^(?:([a-z0-9][a-z0-9._-]*)\/)?([a-z0-9][a-z0-9._-]*)(?::([A-Za-z0-9][A-Za-z0-9._-]*))?$/.exec(ref);
  if (!m) throw new KilnError("invalid_request", `Not a template reference: ${JSON.stringify(ref)} (use name, namespace/name, name:tag or an art_ id)`);
  return { canonicalRef: `${m[1] ?? DEFAULT_NAMESPACE}/${m[2]}`, tag: m[3] };
}

/** Tags a ref without one tries, in order, before falling back to a template's only tag. */
export const IMPLICIT_TAGS = ["default", "latest"] as const;

/**
 * The tag a ref means: the one it names; else `default`, else `latest`, else the template's only tag. Null when
 * that tag does not exist (or the template has several and none of the implicit ones), for the caller to say so.
 */
export function chooseTag(named: string | undefined, tags: string[]): string | null {
  if (named !== undefined) return tags.includes(named) ? named : null;
  for (const t of IMPLICIT_TAGS) if (tags.includes(t)) return t;
  return tags.length === 1 ? tags[0]! : null;
}

/** The template a canonical ref names: by its own name first, then (unless `ownNameOnly`) as one of its aliases. */
export async function findTemplate(db: Db, canonicalRef: string, o: { ownNameOnly?: boolean } = {}): Promise<TemplateRow | undefined> {
  const own = await db.selectFrom("templates").selectAll().where("canonical_ref", "=", canonicalRef).executeTakeFirst();
  if (own || o.ownNameOnly) return own;
  return db
    .selectFrom("template_aliases")
    .innerJoin("templates", "templates.id", "template_aliases.template_id")
    .selectAll("templates")
    .where("template_aliases.alias_ref", "=", canonicalRef)
    .executeTakeFirst();
}

/** The id of the template `id` names: an artifact id, a template id or a (legacy unnamespaced, canonical or alias) ref. */
export async function templateIdOf(db: Db, id: string): Promise<string> {
  if (id.startsWith("tpl_")) {
    const t = await db.selectFrom("templates").select("id").where("id", "=", id).executeTakeFirst();
    if (t) return t.id;
  } else if (id.startsWith("art_")) {
    const a = await db.selectFrom("artifacts").select("template_id").where("id", "=", id).executeTakeFirst();
    if (a) return a.template_id;
  } else {
    let canonicalRef: string | undefined;
    try {
      canonicalRef = parseTemplateRef(id).canonicalRef;
    } catch {
      canonicalRef = undefined;
    }
    if (canonicalRef) {
      const t = await findTemplate(db, canonicalRef);
      if (t) return t.id;
    }
  }
  throw new KilnError("not_found", `No template ${JSON.stringify(id)}`);
}
