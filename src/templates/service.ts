// Logical templates and their artifacts: resolving what a machine asks for (`local/base`, `base`, `base:tag`,
// `art_…`) to the read-only layers the driver mounts, and recording the templates Kiln makes itself (the base
// template at first start, code-interpreter-v1 on first use).

import type { Db, ArtifactRow, TemplateRow } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import type { ArtifactConfig } from "../builder/artifact-config.ts";
import { BASE_TEMPLATE_REF, chooseTag, findTemplate, parseTemplateRef } from "./resolver.ts";

export interface ResolvedTemplate {
  template: TemplateRow;
  artifact: ArtifactRow;
  layers: string[];
}

/** An artifact's layer directories on this host, lowest first. */
export type Localizer = (artifact: ArtifactRow, layers: string[]) => Promise<string[]>;

export interface TemplateService {
  /** The artifact a reference names (`local/base`, `base`, `base:tag`, an alias, `art_…`) and its layers. */
  resolve(ref: string, opts?: { local?: boolean }): Promise<ResolvedTemplate>;
  /** How `resolve(ref, { local: true })` finds an artifact's layers on this host (fetching what it lacks; src/hosts/layers/). */
  setLocalizer(fn: Localizer): void;
  /** Records (once) the logical template local/base and its artifact tagged `default` for a built base layer. */
  registerBase(layerDir: string, digest: string): Promise<ResolvedTemplate>;
  /** The same for another template Kiln makes itself in its cache (`local/code-interpreter-v1`): its layers, lowest first. */
  /** `config`: recorded with a new artifact (one of the same layers already tagged default is kept as it is). */
  registerBuiltIn(canonicalRef: string, layers: string[], digest: string, config?: ArtifactConfig): Promise<ResolvedTemplate>;
  setPending(message: string | null): void;
  /** Why the base template cannot be used yet (being made, or its making failed); null once it is recorded. */
  pendingReason(): string | null;
}

export function createTemplateService(db: Db): TemplateService {
  // While the base template is still being made, asking for it is "try again later", not "no such template".
  let pending: string | null = null;

  let localizer: Localizer | undefined;

  /** `local`: the layers as directories of this host (what a machine or build mounts), fetched from a peer if need be. */
  async function resolve(ref: string, opts: { local?: boolean } = {}): Promise<ResolvedTemplate> {
    let artifact: ArtifactRow | undefined;
    if (ref.startsWith("art_")) {
      artifact = await db.selectFrom("artifacts").selectAll().where("id", "=", ref).executeTakeFirst();
    } else {
      const { canonicalRef, tag } = parseTemplateRef(ref);
      const template = await findTemplate(db, canonicalRef);
      if (template) {
        const tagged = await db.selectFrom("artifact_tags").select(["tag", "artifact_id"]).where("template_id", "=", template.id).orderBy("tag").execute();
        const chosen = chooseTag(tag, tagged.map((t) => t.tag));
        if (chosen === null && tagged.length > 0) {
          // The template exists: say which tags it has rather than that it does not.
          const list = tagged.map((t) => t.tag).join(", ");
          const message =
            tag === undefined
              ? `Template ${canonicalRef} has several tags and none is default or latest: name one (${list}), as ${ref}:${tagged[0]!.tag}`
              : `Template ${canonicalRef} has no tag ${JSON.stringify(tag)}; its tags: ${list}`;
          throw new KilnError("not_found", message, { detail: { code: "not_found", details: { template: canonicalRef, tags: tagged.map((t) => t.tag) } } });
        }
        const artifactId = tagged.find((t) => t.tag === chosen)?.artifact_id;
        if (artifactId) artifact = await db.selectFrom("artifacts").selectAll().where("id", "=", artifactId).executeTakeFirst();
      }
    }
    if (!artifact) {
      if (pending && !ref.startsWith("art_") && parseTemplateRef(ref).canonicalRef === BASE_TEMPLATE_REF) throw new KilnError("unavailable", pending);
      throw new KilnError("not_found", `No template ${JSON.stringify(ref)}`);
    }
    const template = await db.selectFrom("templates").selectAll().where("id", "=", artifact.template_id).executeTakeFirstOrThrow();
    const layers = JSON.parse(artifact.layers_json) as string[];
    return { template, artifact, layers: opts.local && localizer ? await localizer(artifact, layers) : layers };
  }

  /** Records (once) the logical template local/base and its artifact tagged `default` for a built base layer. */
  function registerBase(layerDir: string, digest: string): Promise<ResolvedTemplate> {
    return registerBuiltIn(BASE_TEMPLATE_REF, [layerDir], digest);
  }

  async function registerBuiltIn(canonicalRef: string, layers: string[], digest: string, config?: ArtifactConfig): Promise<ResolvedTemplate> {
    const now = new Date().toISOString();
    const [namespace, name] = canonicalRef.split("/") as [string, string];
    await db.transaction().execute(async (tx) => {
      let template = await tx.selectFrom("templates").selectAll().where("canonical_ref", "=", canonicalRef).executeTakeFirst();
      if (!template) {
        template = { id: newId("tpl"), namespace, name, canonical_ref: canonicalRef, created_at: now, updated_at: now, name_claim_hash: null };
        await tx.insertInto("templates").values(template).execute();
      }
      const tagged = await tx
        .selectFrom("artifact_tags")
        .innerJoin("artifacts", "artifacts.id", "artifact_tags.artifact_id")
        .select(["artifacts.digest", "artifacts.layers_json"])
        .where("artifact_tags.template_id", "=", template.id)
        .where("artifact_tags.tag", "=", "default")
        .executeTakeFirst();
      if (tagged && tagged.digest === digest && tagged.layers_json === JSON.stringify(layers)) return;
      const artifactId = newId("art");
      await tx.insertInto("artifacts").values({ id: artifactId, template_id: template.id, build_id: null, layers_json: JSON.stringify(layers), digest, created_at: now, config_json: config ? JSON.stringify(config) : null }).execute();
      if (tagged) {
        await tx.updateTable("artifact_tags").set({ artifact_id: artifactId, updated_at: now }).where("template_id", "=", template.id).where("tag", "=", "default").execute();
      } else {
        await tx.insertInto("artifact_tags").values({ template_id: template.id, tag: "default", artifact_id: artifactId, updated_at: now }).execute();
      }
      await tx.updateTable("templates").set({ updated_at: now }).where("id", "=", template.id).execute();
    });
    return resolve(canonicalRef);
  }

  function setPending(message: string | null) {
    pending = message;
  }

  /** Why the base template cannot be used yet (being made, or its making failed); null once it is recorded. */
  function pendingReason(): string | null {
    return pending;
  }

  return { setLocalizer: (fn: Localizer) => void (localizer = fn), resolve, registerBase, registerBuiltIn, setPending, pendingReason };
}
