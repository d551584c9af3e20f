// `write_file {path, content, mode?}`: a file with exact content. The content travels base64-encoded, so no byte
// of it is ever read by a shell.

import { Type } from "typebox";
import type { Static } from "typebox";
import { parentDirOf, shellQuote } from "../dockerfile.ts";
import type { Instruction } from "../dockerfile.ts";
import { StepMode, StepPath } from "./fields.ts";

export const WriteFileStep = Type.Object(
  { type: Type.Literal("write_file"), path: StepPath, content: Type.String({ maxLength: 1024 * 1024 }), mode: Type.Optional(StepMode) },
  { additionalProperties: false },
);

export function writeFile(step: Static<typeof WriteFileStep>): Instruction[] {
  const path = shellQuote(step.path);
  const b64 = Buffer.from(step.content, "utf8").toString("base64");
  const parts = [parentDirOf(step.path), `printf '%s' ${shellQuote(b64)} | base64 -d > ${path}`];
  if (step.mode) parts.push(`chmod ${step.mode} ${path}`);
  return [{ op: "RUN", script: parts.join(" && ") }];
}
