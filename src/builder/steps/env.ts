// `env {envs}`: variables for later steps and for machines made from the template. Sorted, so key order in the
// request does not change the Dockerfile's bytes.

import { Type } from "typebox";
import type { Static } from "typebox";
import type { Instruction } from "../dockerfile.ts";
import { EnvName, EnvValue } from "./fields.ts";

export const EnvStep = Type.Object(
  { type: Type.Literal("env"), envs: Type.Record(Type.String({ pattern: EnvName }), EnvValue, { minProperties: 1, additionalProperties: false }) },
  { additionalProperties: false },
);

export function env(step: Static<typeof EnvStep>): Instruction[] {
  const envs = Object.entries(step.envs).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  return [{ op: "ENV", envs }];
}
