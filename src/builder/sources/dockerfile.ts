// The `dockerfile` build source: a user's Dockerfile built by the `buildkit` backend into layer dirs, plus the
// digest that identifies its input (for the final-artifact cache, known before anything is built).

import { createHash } from "node:crypto";
import { join } from "node:path";
import { buildDockerfile, validateDockerfileBuild } from "../backends/buildkit.ts";
import type { ContextFileInput, RegistryCredentialInput } from "../backends/buildkit.ts";
import { importLogEvents } from "../oci/events.ts";
import type { ImportLogEntry } from "../oci/events.ts";
import type { BaseImageAuth } from "../oci/auth.ts";
import type { SourceLayers } from "../oci/types.ts";

export interface DockerfileSourceDeps {
  cacheDir: string;
  dataDir: string;
  insecureRegistries: string[];
  /** BUILDKIT_HOST; unset uses Buildah. */
  buildkitHost?: string;
}

/** The request fields a Dockerfile build uses (DESIGN.md §4 names, camelCased). */
export interface DockerfileRequest {
  dockerfile?: string;
  dockerfilePath?: string;
  buildArgs?: Record<string, string>;
  target?: string;
  secrets?: { id: string; value: string }[];
  registryCredentials?: RegistryCredentialInput[];
  baseImageAuth?: BaseImageAuth;
  contextFiles: (ContextFileInput & { sha256: string })[];
}

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
  });
  return {
    /** Before the stream: an `invalid_request` for anything SPEC.md rejects up front. */
    validate(req: DockerfileRequest): void {
      validateDockerfileBuild(input(req));
    },
    async build(
      req: DockerfileRequest,
      call: { signal: AbortSignal; log?: (entry: ImportLogEntry) => void; count?: (counter: string) => void; resolveTemplate?: (name: string) => Promise<SourceLayers | undefined> },
    ): Promise<SourceLayers & { digest: string }> {
      const events = call.log && call.count ? importLogEvents(call.log, call.count) : {};
      const out = await buildDockerfile({
        ...input(req),
        buildArgs: req.buildArgs,
        target: req.target,
        resolveTemplate: call.resolveTemplate,
        cacheDir: join(deps.cacheDir, "oci"),
        scratchParent: join(deps.dataDir, "builder"),
        insecureRegistries: deps.insecureRegistries,
        buildkitHost: deps.buildkitHost,
        signal: call.signal,
        ...events,
      });
      return { ...out, digest: dockerfileSourceDigest(req) };
    },
  };
}
