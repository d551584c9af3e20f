// `rename {src, dest}`: moves a path within the image.

import { Type } from "typebox";
import type { Static } from "typebox";
import { parentDirOf, shellQuote } from "../dockerfile.ts";
import type { Instruction } from "../dockerfile.ts";
import { StepPath } from "./fields.ts";

export const RenameStep = Type.Object({ type: Type.Literal("rename"), src: StepPath, dest: StepPath }, { additionalProperties: false });

export function rename(step: Static<typeof RenameStep>): Instruction[] {
  return [{ op: "RUN", script: `${parentDirOf(step.dest)} && mv -- ${shellQuote(step.src)} ${shellQuote(step.dest)}` }];
}
