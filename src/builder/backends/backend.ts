// The BuildBackend seam: a backend turns a build source plus instructions into the new layers of an artifact.
// `native` (Kiln's executor, in build machines) is here; `buildkit` (Dockerfile builds) plugs in beside it.

import type { BuildSource, ImageConfig } from "../sources/source.ts";
import type { Instruction } from "../dockerfile.ts";
import type { LogInput } from "../log.ts";
import type { ContextFile } from "../context.ts";

/** One declarative step as the backend runs it: its Dockerfile text and the instructions behind that text. */
export interface PlannedStep {
  /** 1-indexed position among the build's steps. */
  index: number;
  /** Human-readable target for the log and cache entries ("apt_install curl jq"). */
  description: string;
  instructions: Instruction[];
  /** The step's Dockerfile text (part of its cache key). */
  text: string;
  /** Steps that fetch from the network retry on failure; a user command that exits non-zero does not. */
  transient: boolean;
  /** More cache-key inputs than the text and the copied files' digests (a Dockerfile instruction's build args, as HMACs). */
  keyInputs?: string[];
}

/** A Dockerfile build's inputs (buildkit only). Secret and credential values go to the worker, never to a record. */
export interface DockerfileInput {
  text: string;
  path?: string;
  buildArgs?: Record<string, string>;
  target?: string;
  secrets?: { id: string; value: string }[];
  registryCredentials?: { registry: string; username: string; password: string }[];
  baseImageAuth?: unknown;
}

export interface BuildContext {
  buildId: string;
  /** For a Dockerfile build: an empty source (no layers); the backend's output is the whole image. */
  source: BuildSource;
  dockerfile?: DockerfileInput;
  steps: PlannedStep[];
  /** Context files by path (blobs already verified), for COPY. */
  context: ContextFile[];
  /** Visible to build steps only: never in a layer's config, a log entry, a record or a cache key. */
  buildEnvs: Record<string, string>;
  vm: { vcpus: number; memoryMb: number; internet: boolean };
  skipCache: boolean;
  maxAttempts: number;
  signal: AbortSignal;
  /** Sink for SPEC.md build log entries (the build's id, template and timestamp are added by the sink). */
  log(entry: LogInput): void;
  /** Called for every cache lookup/store so the build record's cache_summary counts it. */
  count(counter: string): void;
  /** While the log's store is behind, a promise a backend reading a builder's output waits on (bounded memory). */
  logBackpressure?(): Promise<void> | undefined;
}

export interface BuildOutput {
  /** The new layers on top of the source's, lowest first. */
  layers: { dir: string; digest: string }[];
  config: ImageConfig;
}

export interface BuildBackend {
  readonly name: "native" | "buildkit";
  run(ctx: BuildContext): Promise<BuildOutput>;
  /** Resolves once nothing a finished build left is still being taken down (its build machine). */
  settle?(): Promise<void>;
  /** Takes down what the backend keeps between builds (a build machine booted ahead of time). */
  close?(): Promise<void>;
}
