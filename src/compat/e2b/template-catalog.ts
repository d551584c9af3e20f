// E2B's template catalog on Kiln's (src/templates/catalog.ts) — no second implementation: `GET /templates` lists
// Kiln's templates as E2B templates, `GET /templates/{id}` is one with its builds, `DELETE /templates/{id}` removes
// one as `DELETE /v1/templates/{ref}` does (same refusals), and `POST`/`DELETE /templates/tags` (the SDK's
// `Template.assignTags`/`removeTags`) move Kiln's tags. Kiln's templates belong to the server: every active key sees
// and changes the same ones, as on the native API.

import { Type } from "typebox";
import type { Static } from "typebox";
import type { FastifyInstance } from "fastify";
import type { Services } from "../../services/index.ts";
import type { TemplateView } from "../../templates/catalog.ts";
import { chooseTag, DEFAULT_NAMESPACE } from "../../templates/resolver.ts";
import { MACHINE_DEFAULTS } from "../../machines/records.ts";
import { nextCursor, pageAfter } from "../../store/cursor.ts";
import { ENVD_VERSION } from "./envd.ts";

const Tags = Type.Array(Type.String({ maxLength: 256 }), { maxItems: 256 });
const AssignBody = Type.Object({ target: Type.String({ minLength: 1, maxLength: 512 }), tags: Tags }, { additionalProperties: false });
const RemoveBody = Type.Object({ name: Type.String({ minLength: 1, maxLength: 512 }), tags: Tags }, { additionalProperties: false });
const IdParams = Type.Object({ id: Type.String({ minLength: 1, maxLength: 256 }) });
const ListQuery = Type.Object({ teamID: Type.Optional(Type.String({ maxLength: 256 })) }, { additionalProperties: false });
const BuildsQuery = Type.Object({ limit: Type.Optional(Type.Integer({ minimum: 1, maximum: 100 })), nextToken: Type.Optional(Type.String({ maxLength: 512 })) }, { additionalProperties: false });

/** A Kiln build status as E2B's (`cancelled` is an `error` there). */
function e2bBuildStatus(status: string): "building" | "waiting" | "ready" | "error" {
  return status === "ready" ? "ready" : status === "waiting" ? "waiting" : status === "building" ? "building" : "error";
}

/** A Kiln ref as E2B names it: without Kiln's default namespace (what POST /v3/templates answered). */
const e2bName = (ref: string) => (ref.startsWith(`${DEFAULT_NAMESPACE}/`) ? ref.slice(DEFAULT_NAMESPACE.length + 1) : ref);

export async function templateCatalogRoutes(app: FastifyInstance, services: Services) {
  const { templateCatalog } = services;
  const db = services.store.db;
  const config = { e2b: "control", auth: "key" as const };

  /** The artifact a template's name means to a create (its `default` tag, else `latest`, else its only tag). */
  function current(t: TemplateView) {
    const tag = chooseTag(undefined, Object.keys(t.tags));
    return tag === null ? undefined : t.artifacts.find((a) => a.artifact_id === t.tags[tag]);
  }

  /** E2B's fields every template shows; sizes are Kiln's machine defaults (a template does not fix them). */
  function common(t: TemplateView, spawned: { count: number; last: string | null } | undefined) {
    const names = [e2bName(t.canonical_ref), ...t.aliases.map(e2bName)];
    return { templateID: t.template_id, names, aliases: names, public: false, createdAt: t.created_at, updatedAt: t.updated_at, spawnCount: spawned?.count ?? 0, lastSpawnedAt: spawned?.last ?? null };
  }

  /** How many machines each template made (records Kiln still holds) and when the last one was made. */
  async function spawns(templateId?: string) {
    let q = db.selectFrom("machines").select((eb) => ["template_id", eb.fn.countAll<string>().as("n"), eb.fn.max("created_at").as("last")]).groupBy("template_id");
    if (templateId) q = q.where("template_id", "=", templateId);
    const rows = await q.execute();
    return new Map(rows.map((r) => [r.template_id, { count: Number(r.n), last: (r.last as string | null) ?? null }]));
  }

  app.get("/templates", { config, schema: { hide: true, querystring: ListQuery } }, async () => {
    const { templates } = await templateCatalog.list();
    const counts = new Map((await db.selectFrom("builds").select((eb) => ["template_id", eb.fn.countAll<string>().as("n")]).groupBy("template_id").execute()).map((r) => [r.template_id, Number(r.n)]));
    const spawned = await spawns();
    return Promise.all(
      templates.map(async (t) => {
        const a = current(t);
        // Without an artifact its name means nothing yet: the newest build says why (building, or failed).
        const newest = a ? undefined : (await services.builds.list(t.template_id, { limit: 1 })).builds[0];
        return {
          ...common(t, spawned.get(t.template_id)),
          buildID: a?.build_id ?? newest?.build_id ?? "",
          buildStatus: a ? "ready" : newest ? e2bBuildStatus(newest.status) : "error",
          buildCount: counts.get(t.template_id) ?? 0,
          cpuCount: MACHINE_DEFAULTS.vcpus,
          memoryMB: MACHINE_DEFAULTS.memoryMb,
          diskSizeMB: MACHINE_DEFAULTS.diskMb,
          envdVersion: ENVD_VERSION,
          createdBy: null,
        };
      }),
    );
  });

  app.get("/templates/:id", { config, schema: { hide: true, params: IdParams, querystring: BuildsQuery } }, async (req, reply) => {
    const { id } = req.params as Static<typeof IdParams>;
    const q = req.query as Static<typeof BuildsQuery>;
    const t = await templateCatalog.get(id);
    // nextToken is the keyset cursor Kiln's own build history pages with (src/store/cursor.ts).
    const after = pageAfter(q.nextToken);
    const page = await services.builds.list(t.template_id, { limit: q.limit ?? 100, after });
    const next = nextCursor(page);
    if (next) reply.header("x-next-token", next);
    const builds = page.builds.map((b) => ({
      buildID: b.build_id,
      status: e2bBuildStatus(b.status),
      createdAt: b.created_at,
      updatedAt: b.updated_at,
      ...(b.finished_at ? { finishedAt: b.finished_at } : {}),
      cpuCount: MACHINE_DEFAULTS.vcpus,
      memoryMB: MACHINE_DEFAULTS.memoryMb,
      diskSizeMB: MACHINE_DEFAULTS.diskMb,
      envdVersion: ENVD_VERSION,
    }));
    return { ...common(t, (await spawns(t.template_id)).get(t.template_id)), builds };
  });

  // Template.assignTags(target, tags): the tags point at the artifact `target` (name:tag) names → 201 {buildID, tags}.
  app.post("/templates/tags", { config, schema: { hide: true, body: AssignBody } }, async (req, reply) => {
    const { target, tags } = req.body as Static<typeof AssignBody>;
    const r = await templateCatalog.assignTags(target, tags);
    return reply.code(201).send({ buildID: r.buildId ?? "", tags: r.tags });
  });

  // Template.removeTags(name, tags) → 204.
  app.delete("/templates/tags", { config, schema: { hide: true, body: RemoveBody } }, async (req, reply) => {
    const { name, tags } = req.body as Static<typeof RemoveBody>;
    await templateCatalog.removeTags(name, tags);
    return reply.code(204).send();
  });

  /** DELETE /templates/{id} of a template (a snapshot's is control.ts's): Kiln's delete, with its refusals. */
  async function deleteTemplate(id: string) {
    await templateCatalog.remove(id);
  }
  return { deleteTemplate };
}
