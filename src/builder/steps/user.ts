// `user {user}`: the user later steps run as, and the default user of machines made from the template.

import { Type } from "typebox";
import type { Static } from "typebox";
import type { Instruction } from "../dockerfile.ts";
import { StepUser } from "./fields.ts";

export const UserStep = Type.Object({ type: Type.Literal("user"), user: StepUser }, { additionalProperties: false });

export function user(step: Static<typeof UserStep>): Instruction[] {
  return [{ op: "USER", user: step.user }];
}
