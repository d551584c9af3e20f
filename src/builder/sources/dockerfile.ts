// The `buildkit` BuildBackend the pipeline calls for a Dockerfile build: the Dockerfile built by a real builder
// into layer dirs (its whole image: the source is empty), checked before the stream, with an input digest.

import { createHash } from "node:crypto";
import { join } from "node:path";
import { buildDockerfile, sweepDockerfileBuilds, validateDockerfileBuild } from "../backends/buildkit.ts";
import type { ContextFileInput, DockerfileBuild } from "../backends/buildkit.ts";
import { importLogEvents } from "../oci/events.ts";
import { instructionCount } from "./dockerfile-plan.ts";
import type { ImportLogEntry } from "../oci/events.ts";
import { dockerfileImages, finalStageBase } from "../backends/dockerfile-images.ts";
import { BASE_USER } from "../base-template.ts";
import type { BaseImageAuth } from "../oci/auth.ts";
import type { ImportLimits } from "../oci/limits.ts";
import type { SourceLayers } from "../oci/types.ts";
import type { BuildBackend, BuildContext, BuildOutput, DockerfileInput } from "../backends/backend.ts";
import type { ContextFile } from "../context.ts";

export interface DockerfileSourceDeps {
  cacheDir: string;
  dataDir: string;
  /** KILN_OCI_MAX_*: the built image is imported within them. */
  ociLimits?: ImportLimits;
  insecureRegistries: string[];
  /** BUILDKIT_HOST; unset uses Buildah. */
  buildkitHost?: string;
  /** KILN_MACHINE_HOST_ACCESS: RUN steps reach host loopback as machines do (host.kiln.internal). */
  hostAccess?: boolean;
  /** KILN_BUILD_STEP_TIMEOUT_S and KILN_BUILD_TIMEOUT_S, in ms. */
  stepTimeoutMs?: number;
  buildTimeoutMs?: number;
  /** A FROM name's Kiln template, if it is one (set late: the template service exists after the backends). */
  resolveTemplate?: (name: string) => Promise<SourceLayers | undefined>;
}

/** The pipeline's Dockerfile input and context, in this module's terms. */
export function dockerfileRequestOf(input: DockerfileInput, context: ContextFile[]): DockerfileRequest {
  return {
    dockerfile: input.text,
    dockerfilePath: input.path,
    buildArgs: input.buildArgs,
    target: input.target,
    secrets: input.secrets,
    registryCredentials: input.registryCredentials,
    baseImageAuth: input.baseImageAuth as BaseImageAuth | undefined,
    contextFiles: context,
  };
}

/**
 * The `buildkit` backend: `run` builds the Dockerfile and returns its image as the artifact's layers; `validate`
 * is what the pipeline checks before the stream (credentials for unused registries, authenticated-build rules).
 */
export function createBuildkitBackend(deps: DockerfileSourceDeps): BuildBackend & { validate(input: DockerfileInput, context: ContextFile[]): void; sweep(): Promise<number> } {
  const source = createDockerfileSource(deps);
  return {
    name: "buildkit",
    validate: (input, context) => source.validate(dockerfileRequestOf(input, context)),
    async run(ctx: BuildContext): Promise<BuildOutput> {
      if (!ctx.dockerfile) throw new Error("the buildkit backend builds Dockerfiles only");
      const out = await source.build(dockerfileRequestOf(ctx.dockerfile, ctx.context), {
        signal: ctx.signal,
        log: ctx.log,
        count: ctx.count,
        resolveTemplate: deps.resolveTemplate,
        vm: ctx.vm,
        logBackpressure: ctx.logBackpressure,
      });
      return { layers: out.layers, config: out.config };
    },
    /** At start: what builds of a dead Kiln left (processes, namespaces, egress rules, cgroups, scratch dirs). */
    sweep: () => sweepDockerfileBuilds(join(deps.dataDir, "builder")),
  };
}

/** The request fields a Dockerfile build uses (DESIGN.md §4 names, camelCased). */
export type DockerfileRequest = Pick<DockerfileBuild, "dockerfile" | "dockerfilePath" | "buildArgs" | "target" | "secrets" | "registryCredentials" | "baseImageAuth"> & {
  contextFiles: (ContextFileInput & { sha256: string })[];
};

/**
 * What the build's output depends on, without a secret: the Dockerfile, its args and target, the context's file
 * digests and modes, and which secret ids exist (their values are not part of any key).
 */
export function dockerfileSourceDigest(req: DockerfileRequest): string {
  const h = createHash("sha256").update("dockerfile-source-1\n");
  h.update(JSON.stringify([req.dockerfile ?? null, req.dockerfilePath ?? null, Object.entries(req.buildArgs ?? {}).sort(), req.target ?? null, (req.secrets ?? []).map((s) => s.id).sort()]));
  for (const f of [...req.contextFiles].sort((a, b) => (a.path < b.path ? -1 : 1))) h.update(`\n${f.path}\0${f.sha256}\0${f.mode ?? ""}`);
  return `sha256:${h.digest("hex")}`;
}

export function createDockerfileSource(deps: DockerfileSourceDeps) {
  const input = (req: DockerfileRequest) => ({
    contextFiles: req.contextFiles,
    dockerfile: req.dockerfile,
    dockerfilePath: req.dockerfilePath,
    secrets: req.secrets,
    registryCredentials: req.registryCredentials,
    baseImageAuth: req.baseImageAuth,
    buildArgs: req.buildArgs,
  });
  return {
    /** Before the stream: an `invalid_request` for anything SPEC.md rejects up front. */
    validate(req: DockerfileRequest): void {
      validateDockerfileBuild(input(req));
    },
    async build(
      req: DockerfileRequest,
      call: {
        signal: AbortSignal;
        log?: (entry: ImportLogEntry) => void;
        count?: (counter: string) => void;
        resolveTemplate?: (name: string) => Promise<SourceLayers | undefined>;
        vm?: { vcpus: number; memoryMb: number; internet: boolean };
        logBackpressure?: () => Promise<void> | undefined;
      },
    ): Promise<SourceLayers & { digest: string }> {
      const events: Partial<ReturnType<typeof importLogEvents>> = call.log && call.count ? importLogEvents(call.log, call.count) : {};
      // The builder's own steps (`STEP n/m: …`) are the build's steps: their lines carry phase `step` and the index,
      // and the import of the result is `finalize`; progress lines fill any silence.
      if (call.log && events.onMessage) {
        const log = call.log;
        // Buildah numbers each stage's steps (`[2/3] STEP 1/4: …`); the log numbers them through the whole file.
        const total = req.dockerfile ? instructionCount(req.dockerfile) : 0;
        let step: { index: number; total: number } | undefined;
        let imported = false;
        events.onMessage = (message: string) => {
          const m = /^(?:\[\d+\/\d+\] )?STEP \d+\/\d+: /.exec(message);
          if (m) step = { index: (step?.index ?? 0) + 1, total: Math.max(total, (step?.index ?? 0) + 1) };
          if (/^(COMMIT kiln-build-output|\d+ layers?, |still importing)/.test(message)) imported = true; // the last stage's commit, push and import
          const phase = imported ? "finalize" : step ? "step" : "preparing";
          log({ kind: "message", phase, message, ...(step && !imported ? { step_index: step.index, total_steps: step.total } : {}) });
        };
      }
      const out = await buildDockerfile({
        ...input(req),
        target: req.target,
        resolveTemplate: call.resolveTemplate,
        cacheDir: join(deps.dataDir, "oci"), // the importer's cache, shared with base_image imports
        ociLimits: deps.ociLimits,
        scratchParent: join(deps.dataDir, "builder"),
        insecureRegistries: deps.insecureRegistries,
        buildkitHost: deps.buildkitHost,
        hostAccess: deps.hostAccess,
        stepTimeoutMs: deps.stepTimeoutMs,
        buildTimeoutMs: deps.buildTimeoutMs,
        vm: call.vm,
        logBackpressure: call.logBackpressure,
        signal: call.signal,
        ...events,
      });
      const config = { ...out.config, user: await machineUser(req, out, call) };
      return { ...out, config, digest: dockerfileSourceDigest(req) };
    },
  };
}

/**
 * Who machines from a Dockerfile template run as: the image's USER when it has one (the Dockerfile's, or the one
 * its FROM image set); with none at all, a Dockerfile on a Kiln template keeps that template's user (`user` for
 * local/base, whose RUN steps still ran as root, as the image has no USER), and on any other image it is root, as
 * container runtimes run it. The build log says which, and why.
 */
async function machineUser(
  req: DockerfileRequest,
  out: SourceLayers & { userIds?: unknown },
  call: { log?: (entry: ImportLogEntry) => void; resolveTemplate?: (name: string) => Promise<SourceLayers | undefined> },
): Promise<string | undefined> {
  let user: string | undefined = out.config.user;
  let why = `the image's USER`;
  if (!out.userIds) {
    const base = req.dockerfile ? finalStageBase(dockerfileImages(req.dockerfile), req.target) : null;
    const template = base ? await call.resolveTemplate?.(base) : undefined;
    if (template) {
      user = template.config.user;
      why = `the Dockerfile sets no USER, so machines keep the user of template ${base}`;
    } else why = "the image sets no USER, so machines run as root, as container runtimes run it; add USER to change it";
  }
  call.log?.({ kind: "message", phase: "finalize", message: `machines from this template run as ${JSON.stringify(user ?? BASE_USER)} (${why})` });
  return user;
}
