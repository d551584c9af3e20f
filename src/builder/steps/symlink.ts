// `symlink {target, path}`: a symbolic link at path pointing at target (replacing what is there).

import { Type } from "typebox";
import type { Static } from "typebox";
import { parentDirOf, shellQuote } from "../dockerfile.ts";
import type { Instruction } from "../dockerfile.ts";
import { StepPath } from "./fields.ts";

export const SymlinkStep = Type.Object({ type: Type.Literal("symlink"), target: StepPath, path: StepPath }, { additionalProperties: false });

export function symlink(step: Static<typeof SymlinkStep>): Instruction[] {
  return [{ op: "RUN", script: `${parentDirOf(step.path)} && ln -sfn -- ${shellQuote(step.target)} ${shellQuote(step.path)}` }];
}
