// `copy {src, dest, mode?, owner?}`: a file or directory of the build context into the image.

import { Type } from "typebox";
import type { Static } from "typebox";
import type { Instruction } from "../dockerfile.ts";
import { StepMode, StepPath, StepUser } from "./fields.ts";

export const CopyStep = Type.Object(
  { type: Type.Literal("copy"), src: StepPath, dest: StepPath, mode: Type.Optional(StepMode), owner: Type.Optional(StepUser) },
  { additionalProperties: false },
);

export function copy(step: Static<typeof CopyStep>): Instruction[] {
  return [{ op: "COPY", src: step.src, dest: step.dest, mode: step.mode, owner: step.owner }];
}
