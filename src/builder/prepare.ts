// Everything a build request is checked and resolved against before its stream starts: backend and field rules,
// the name and alias (claimed here), context blobs, the source, the planned steps and the layer budget.

import { createHash, timingSafeEqual } from "node:crypto";
import { join } from "node:path";
import type { Db, TemplateRow } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import type { TemplateService } from "../templates/service.ts";
import { DEFAULT_NAMESPACE, BASE_TEMPLATE_REF, parseTemplateRef } from "../templates/resolver.ts";
import type { BuildRequestT } from "./request.ts";
import type { BuildBackendName, SourceType } from "./enums.ts";
import type { BlobStore, ContextFile } from "./context.ts";
import { selectContext } from "./context.ts";
import { planSteps } from "./steps/index.ts";
import { assembleDockerfile, sha256 } from "./dockerfile.ts";
import type { DockerfileInput, PlannedStep } from "./backends/backend.ts";
import { MAX_LAYERS, stackFits, touchesFiles } from "./backends/native.ts";
import { contextDigest } from "./cache/keys.ts";
import { templateBaseSource } from "./sources/template-base.ts";
import type { BuildSource } from "./sources/source.ts";
import { emptyConfig } from "./sources/source.ts";
import { argDigest, argKeyIn, instructionCount, planDockerfile } from "./sources/dockerfile-plan.ts";
import { dockerfileImages, externalFroms } from "./backends/dockerfile-images.ts";
import type { BuildExtensions } from "./extensions.ts";
import type { SnapshotBases } from "./sources/snapshot.ts";

export const BUILD_DEFAULTS = { tags: ["default"], vcpus: 1, memoryMb: 1024, internet: true, maxAttempts: 3 } as const;

/** Everything checked and resolved before the stream starts. */
export interface PreparedBuild {
  buildId: string;
  template: TemplateRow;
  name: string;
  tags: string[];
  backend: BuildBackendName;
  sourceType: SourceType;
  request: BuildRequestT;
  source: BuildSource | null; // null: an OCI import the pipeline does first
  steps: PlannedStep[];
  context: ContextFile[];
  contextDigest: string;
  dockerfileDigest: string | null;
  dockerfile: string;
  triggeredBy: string | null;
  /** from_snapshot: the snapshot whose files the source phase lays over `source` (its template). */
  fromSnapshot: { id: string; memory: boolean } | null;
  /**
   * A Dockerfile build run by Kiln's own executor (`native`, its one stage on a Kiln template: `steps` are its
   * instructions), or by the Dockerfile builder (`builder`, with why). Declarative builds: undefined.
   */
  dockerfileExecutor?: { kind: "native"; setsUser: boolean; from: string } | { kind: "builder"; why: string; instructions: number };
  /** What the whole build's input digest covers besides the Dockerfile text: build args (as HMACs), FROM templates' digests. */
  keyInputs: string[];
}

export function buildVm(req: BuildRequestT) {
  return { vcpus: req.vm?.vcpus ?? BUILD_DEFAULTS.vcpus, memoryMb: req.vm?.memory_mb ?? BUILD_DEFAULTS.memoryMb, internet: req.vm?.internet ?? BUILD_DEFAULTS.internet };
}

/** A Dockerfile build's inputs as the buildkit backend takes them (undefined for other builds). */
export function dockerfileInput(req: BuildRequestT): DockerfileInput | undefined {
  if (!req.dockerfile) return undefined;
  return { text: req.dockerfile, path: req.dockerfile_path, buildArgs: req.build_args, target: req.target, secrets: req.secrets, registryCredentials: req.registry_credentials, baseImageAuth: req.base_image_auth };
}

function hashToken(token: string): string {
  return createHash("sha256").update(token).digest("hex");
}

export function createPreparer(deps: { db: Db; templates: TemplateService; blobs: BlobStore; layersDir: string; extensions?: BuildExtensions; snapshots?: SnapshotBases }) {
  const { db, templates, blobs, layersDir } = deps;

  async function prepare(req: BuildRequestT, triggeredBy: string | null): Promise<PreparedBuild> {
    if (req.dockerfile && req.build_backend === "native") throw new KilnError("invalid_request", "A dockerfile build cannot use build_backend \"native\": Dockerfile builds use buildkit");
    if (req.dockerfile && req.steps?.length) throw new KilnError("invalid_request", "Give either dockerfile or steps, not both");
    if (req.from_snapshot && (req.dockerfile || req.base_image)) throw new KilnError("invalid_request", "Give either from_snapshot or dockerfile/base_image: a snapshot's build starts on its template");
    if (req.from_snapshot && req.build_backend === "buildkit") throw new KilnError("invalid_request", "A from_snapshot build runs its steps with build_backend \"native\"");
    if (req.dockerfile && req.base_image) throw new KilnError("invalid_request", "Give either dockerfile or base_image (a Dockerfile names its own FROM)");
    const backend: BuildBackendName = req.build_backend ?? (req.dockerfile ? "buildkit" : "native");
    if (!req.dockerfile && backend === "buildkit") throw new KilnError("invalid_request", "build_backend \"buildkit\" builds a dockerfile; declarative and base_image builds use native");
    if (backend === "native") {
      for (const f of ["secrets", "registry_credentials", "build_args", "target", "dockerfile_path"] as const) {
        if (req[f] !== undefined) throw new KilnError("invalid_request", `${f} applies to Dockerfile (buildkit) builds only`);
      }
    }
    if (req.dockerfile && !deps.extensions?.buildkit) throw new KilnError("build_rejected", "Dockerfile builds need the buildkit backend, which this server does not have");

    // Name precedence: name, then template_name, then alias, then a generated name.
    const explicitName = req.name ?? req.template_name;
    const rawName = explicitName ?? req.alias ?? `tpl-${newId("tpl").slice(-10)}`;
    const canonicalRef = parseTemplateRef(rawName).canonicalRef;
    const aliasRef = explicitName && req.alias ? `${DEFAULT_NAMESPACE}/${req.alias}` : null;
    if (aliasRef === canonicalRef) throw new KilnError("invalid_request", "alias must differ from the template's own name");
    if (canonicalRef === BASE_TEMPLATE_REF) throw new KilnError("conflict", `${BASE_TEMPLATE_REF} is made by Kiln itself and cannot be rebuilt`);

    // Context blobs: present and with the bytes their digest names (each lookup is a file_blob cache lookup).
    const context: ContextFile[] = [];
    const seen = new Set<string>();
    for (const f of req.context?.files ?? []) {
      if (seen.has(f.path)) throw new KilnError("invalid_request", `context.files names ${JSON.stringify(f.path)} twice`);
      seen.add(f.path);
      const state = await blobs.verify(f.sha256);
      if (state !== "ok") {
        throw new KilnError("invalid_request", state === "missing" ? `Context blob ${f.sha256} (${f.path}) is missing: upload it with PUT /v1/templates/blobs/${f.sha256}` : `Context blob ${f.sha256} (${f.path}) does not match its sha256: upload it again`, {
          detail: { code: "invalid_request", phase: "preparing", cache_subject: f.path, details: { sha256: f.sha256, reason: state } },
        });
      }
      context.push({ path: f.path, sha256: f.sha256, mode: f.mode, blobPath: blobs.pathOf(f.sha256) });
    }
    for (const step of req.steps ?? []) {
      if (step.type === "copy" && selectContext(context, step.src).length === 0) throw new KilnError("invalid_request", `copy step: ${JSON.stringify(step.src)} is not in context.files`);
    }
    if (req.dockerfile) deps.extensions?.buildkit?.validate?.(dockerfileInput(req)!, context);

    // The source: local/base, a Kiln template named by base_image (template_base), or an OCI image (oci_import).
    let source: BuildSource | null = null;
    let sourceType: SourceType = req.dockerfile ? "dockerfile" : "declarative";
    let fromSnapshot: PreparedBuild["fromSnapshot"] = null;
    if (req.from_snapshot) {
      // SPEC's source types have no word for a snapshot: it is a template base (its template) plus the machine's files.
      if (!deps.snapshots) throw new KilnError("build_rejected", "This server keeps no snapshots to build from");
      const snap = await deps.snapshots.buildBase(req.from_snapshot);
      source = templateBaseSource(await templates.resolve(snap.artifactId, { local: true }), "template_base");
      sourceType = "template_base";
      fromSnapshot = { id: snap.id, memory: snap.memory };
    } else if (req.base_image) {
      const local = await resolveTemplate(req.base_image);
      if (local) {
        source = templateBaseSource(local, "template_base");
        sourceType = "template_base";
      } else {
        if (!deps.extensions?.ociImport) throw new KilnError("build_rejected", `base_image ${JSON.stringify(req.base_image)} is not a Kiln template, and this server cannot import OCI images`);
        sourceType = "oci_import";
      }
    } else if (!req.dockerfile) {
      source = templateBaseSource(await templates.resolve(BASE_TEMPLATE_REF, { local: true }), "declarative");
    }
    let steps = planSteps(req.steps ?? [], source?.config.user ?? "root");
    let dockerfileExecutor: PreparedBuild["dockerfileExecutor"];
    const keyInputs: string[] = [];
    if (req.dockerfile) {
      // One stage on a Kiln template, in plain instructions: Kiln's executor runs it, an instruction a step, on the
      // template's own layers. Anything else: the Dockerfile builder produces every layer.
      const argKey = await argKeyIn(join(layersDir, "..", "builder"));
      // The one FROM first: its template's env is what ENV and WORKDIR values expand against.
      const froms = dockerfileImages(req.dockerfile).froms;
      const base = froms.length === 1 && !froms[0].image.includes("$") ? await resolveTemplate(froms[0].image) : null;
      const baseEnv = base ? templateBaseSource(base).config.env : {};
      const plan = req.dockerfile_path === undefined ? planDockerfile(req.dockerfile, { buildArgs: req.build_args, target: req.target, secrets: req.secrets, argKey, baseEnv }) : { builder: "dockerfile_path names a file of the context" };
      const fits = "from" in plan && base && stackFits(base.layers, plan.steps.filter(touchesFiles).length, layersDir);
      if ("from" in plan && base && fits) {
        source = templateBaseSource(base, "dockerfile");
        steps = plan.steps;
        for (const s of steps) keyInputs.push(...(s.keyInputs ?? []));
        dockerfileExecutor = { kind: "native", setsUser: plan.setsUser, from: plan.from };
      } else {
        source = { type: "dockerfile", digest: sha256(""), description: req.dockerfile_path ?? "Dockerfile", layers: [], config: emptyConfig() };
        dockerfileExecutor = { kind: "builder", instructions: instructionCount(req.dockerfile), why: "builder" in plan ? plan.builder : !base ? `FROM ${plan.from} is not a Kiln template` : `its ${plan.steps.length} instructions would stack more layers than a machine root takes` };
        // The builder's output depends on the build args and on the Kiln templates it stands on: a rebuilt template
        // or another arg value is another input.
        for (const [k, v] of Object.entries(req.build_args ?? {}).sort()) keyInputs.push(argDigest(argKey, k, v));
        for (const f of externalFroms(dockerfileImages(req.dockerfile))) {
          const t = f.image.includes("$") ? null : await resolveTemplate(f.image);
          if (t) keyInputs.push(`from ${f.image} ${t.artifact.digest}`);
        }
      }
    }

    const added = steps.filter(touchesFiles).length + (fromSnapshot ? 1 : 0);
    const stack = (source?.layers.length ?? 0) + added;
    if (!stackFits(source?.layers.map((l) => l.dir) ?? [], added, layersDir)) {
      throw new KilnError("invalid_request", `This build would stack ${stack} layers; a template may have at most ${MAX_LAYERS} (merge steps, e.g. several commands in one run step)`);
    }
    const dockerfile = req.dockerfile ?? assembleDockerfile(req.base_image ?? fromSnapshot?.id ?? BASE_TEMPLATE_REF, steps.map((s) => s.text));

    // Claim the name, or find it; an alias another template owns is a conflict. Nothing stream-related happened yet.
    const template = await claimTemplate(canonicalRef, aliasRef, req.name_claim_token);
    return {
      buildId: newId("bld"),
      template,
      name: template.canonical_ref,
      tags: req.tags ?? [...BUILD_DEFAULTS.tags],
      backend,
      sourceType,
      request: req,
      source,
      steps,
      context,
      contextDigest: contextDigest(context),
      dockerfileDigest: sha256(dockerfile),
      dockerfile,
      triggeredBy,
      fromSnapshot,
      dockerfileExecutor,
      keyInputs,
    };
  }

  async function resolveTemplate(ref: string) {
    try {
      return await templates.resolve(ref, { local: true });
    } catch (err) {
      if (err instanceof KilnError && (err.code === "not_found" || err.code === "invalid_request")) return null;
      throw err;
    }
  }

  async function claimTemplate(canonicalRef: string, aliasRef: string | null, claimToken: string | undefined): Promise<TemplateRow> {
    return db.transaction().execute(async (tx) => {
      const now = new Date().toISOString();
      let template = await tx.selectFrom("templates").selectAll().where("canonical_ref", "=", canonicalRef).executeTakeFirst();
      const owner = await tx.selectFrom("template_aliases").select("template_id").where("alias_ref", "=", canonicalRef).executeTakeFirst();
      if (!template && owner) throw new KilnError("conflict", `${canonicalRef} is an alias of another template`);
      if (template?.name_claim_hash) {
        const given = claimToken ? Buffer.from(hashToken(claimToken)) : Buffer.alloc(64);
        if (!timingSafeEqual(given, Buffer.from(template.name_claim_hash))) throw new KilnError("conflict", `The name ${canonicalRef} is reserved by another name_claim_token`);
      }
      if (aliasRef) {
        const aliasOwner = await tx.selectFrom("template_aliases").select("template_id").where("alias_ref", "=", aliasRef).executeTakeFirst();
        const aliasTemplate = await tx.selectFrom("templates").select("id").where("canonical_ref", "=", aliasRef).executeTakeFirst();
        if (aliasTemplate || (aliasOwner && aliasOwner.template_id !== template?.id)) throw new KilnError("conflict", `The alias ${aliasRef} belongs to another template`);
      }
      if (!template) {
        const [namespace, name] = canonicalRef.split("/");
        template = { id: newId("tpl"), namespace, name, canonical_ref: canonicalRef, created_at: now, updated_at: now, name_claim_hash: claimToken ? hashToken(claimToken) : null };
        await tx.insertInto("templates").values(template).execute();
      }
      if (aliasRef) {
        const mine = await tx.selectFrom("template_aliases").select("alias_ref").where("alias_ref", "=", aliasRef).executeTakeFirst();
        if (!mine) await tx.insertInto("template_aliases").values({ alias_ref: aliasRef, template_id: template.id, created_at: now }).execute();
      }
      return template;
    });
  }

  return prepare;
}
