// A build that fails in its pipeline: the phase, step and attempt it failed at, and whether trying again may help.
// Becomes the terminal `error` entry (error_detail.code = "build_error") and the record's failure_phase.

import { KilnError } from "../errors.ts";
import type { BuildPhase } from "./enums.ts";

export class BuildFailure extends KilnError {
  readonly phase: BuildPhase;
  readonly stepIndex: number | undefined;
  readonly retryable: boolean;
  readonly suggestedAction: string;
  /** Goes to the terminal entry's error_detail.details (a failed step's last lines of output), never to the record. */
  readonly details: Record<string, unknown> | undefined;

  constructor(message: string, opts: { phase: BuildPhase; stepIndex?: number; retryable?: boolean; suggestedAction?: string; details?: Record<string, unknown>; cause?: unknown }) {
    super("build_error", message, { cause: opts.cause });
    this.phase = opts.phase;
    this.stepIndex = opts.stepIndex;
    this.retryable = opts.retryable ?? false;
    this.suggestedAction = opts.suggestedAction ?? (this.retryable ? "retry the build" : "fix the step and build again");
    this.details = opts.details;
  }
}

/** The build was cancelled (POST …/cancel); not a failure. */
export class BuildCancelled extends Error {
  constructor() {
    super("the build was cancelled");
    this.name = "BuildCancelled";
  }
}

/** How a build that did not finish ends: cancelled, or an error with what its terminal entry and record say. */
export type BuildEnding =
  | { status: "cancelled"; phase: BuildPhase; reason: "cancelled" }
  | { status: "error"; phase: BuildPhase; reason: string; stepIndex: number | undefined; retryable: boolean; suggestedAction: string; details?: Record<string, unknown>; unexpected: boolean };

/**
 * The one decision of whose fault a build's end is: a cancel (not during shutdown) is `cancelled`; a BuildFailure
 * carries the user's step, phase and advice; a shutdown says so; anything else is ours (internal, retryable, logged).
 */
export function decideEnding(err: unknown, o: { phase: BuildPhase; aborted: boolean; shuttingDown: boolean }): BuildEnding {
  if ((err instanceof BuildCancelled || o.aborted) && !o.shuttingDown) return { status: "cancelled", phase: o.phase, reason: "cancelled" };
  const f = err instanceof BuildFailure ? err : null;
  return {
    status: "error",
    phase: f?.phase ?? o.phase,
    reason: o.shuttingDown ? INTERRUPTED_REASON : (f?.message ?? (err instanceof KilnError ? err.message : "internal error in the build pipeline")),
    stepIndex: f?.stepIndex,
    retryable: f?.retryable ?? true,
    suggestedAction: f?.suggestedAction ?? "retry the build; if it fails again, report it with the build id",
    ...(f?.details ? { details: f.details } : {}),
    unexpected: !f && !o.shuttingDown,
  };
}

/** Why a build the server stopped during ended. */
export const INTERRUPTED_REASON = "the server stopped during the build";

/** The terminal `error` entry's error_detail, the same for a failed build and one a restart found interrupted. */
export function errorDetail(buildId: string, e: { reason: string; phase: BuildPhase; stepIndex: number | undefined; retryable: boolean; suggestedAction: string; details?: Record<string, unknown> }) {
  return {
    code: "build_error" as const,
    message: e.reason,
    phase: e.phase,
    step_index: e.stepIndex,
    retryable: e.retryable,
    suggested_action: e.suggestedAction,
    build_id: buildId,
    ...(e.details ? { details: e.details } : {}),
  };
}
