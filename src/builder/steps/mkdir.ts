// `mkdir {path, mode?}`: a directory and its parents.

import { Type } from "typebox";
import type { Static } from "typebox";
import { shellQuote } from "../dockerfile.ts";
import type { Instruction } from "../dockerfile.ts";
import { StepMode, StepPath } from "./fields.ts";

export const MkdirStep = Type.Object({ type: Type.Literal("mkdir"), path: StepPath, mode: Type.Optional(StepMode) }, { additionalProperties: false });

export function mkdir(step: Static<typeof MkdirStep>): Instruction[] {
  return [{ op: "RUN", script: `mkdir -p ${step.mode ? `-m ${step.mode} ` : ""}-- ${shellQuote(step.path)}` }];
}
