// `git_clone {url, dest, branch?, depth?}`: a repository into the image.

import { Type } from "typebox";
import type { Static } from "typebox";
import { shellQuote } from "../dockerfile.ts";
import type { Instruction } from "../dockerfile.ts";
import { Operand, StepPath } from "./fields.ts";

export const GitCloneStep = Type.Object(
  {
    type: Type.Literal("git_clone"),
    url: Type.String({ minLength: 1, maxLength: 4096, pattern: "^(https?|git|ssh)://[^\\s\\x00]+$" }),
    dest: StepPath,
    branch: Type.Optional(Operand),
    depth: Type.Optional(Type.Integer({ minimum: 1, maximum: 1_000_000 })),
  },
  { additionalProperties: false },
);

export function gitClone(step: Static<typeof GitCloneStep>): Instruction[] {
  const flags = [step.depth ? `--depth ${step.depth}` : "", step.branch ? `--branch ${shellQuote(step.branch)}` : ""].filter(Boolean).join(" ");
  return [{ op: "RUN", script: `git clone ${flags ? flags + " " : ""}-- ${shellQuote(step.url)} ${shellQuote(step.dest)}` }];
}
