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
