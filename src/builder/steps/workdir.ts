// `workdir {path}`: the working directory of later steps and of machines made from the template (created if missing).

import { Type } from "typebox";
import type { Static } from "typebox";
import type { Instruction } from "../dockerfile.ts";
import { AbsolutePath } from "./fields.ts";

export const WorkdirStep = Type.Object({ type: Type.Literal("workdir"), path: AbsolutePath }, { additionalProperties: false });

export function workdir(step: Static<typeof WorkdirStep>): Instruction[] {
  return [{ op: "WORKDIR", path: step.path }];
}
