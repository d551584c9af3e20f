// `remove {path, recursive?}`: a file, or a directory tree when recursive.

import { Type } from "typebox";
import type { Static } from "typebox";
import { shellQuote } from "../dockerfile.ts";
import type { Instruction } from "../dockerfile.ts";
import { StepPath } from "./fields.ts";

export const RemoveStep = Type.Object({ type: Type.Literal("remove"), path: StepPath, recursive: Type.Optional(Type.Boolean()) }, { additionalProperties: false });

export function remove(step: Static<typeof RemoveStep>): Instruction[] {
  return [{ op: "RUN", script: `rm -f${step.recursive ? "r" : ""} -- ${shellQuote(step.path)}` }];
}
