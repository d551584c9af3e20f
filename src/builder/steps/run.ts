// `run {command, user?}`: a shell line, optionally as another user for this step only.

import { Type } from "typebox";
import type { Static } from "typebox";
import { asUser } from "../dockerfile.ts";
import type { Instruction, StepState } from "../dockerfile.ts";
import { StepUser } from "./fields.ts";

export const RunStep = Type.Object(
  { type: Type.Literal("run"), command: Type.String({ minLength: 1, maxLength: 131072, pattern: "^[^\\x00]*$" }), user: Type.Optional(StepUser) },
  { additionalProperties: false },
);

export function run(step: Static<typeof RunStep>, state: StepState): Instruction[] {
  return asUser(step.user ?? state.user, state, [{ op: "RUN", script: step.command }]);
}
