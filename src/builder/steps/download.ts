// `download {url, dest, sha256?, mode?}`: a file over HTTP(S), its digest checked when given.

import { Type } from "typebox";
import type { Static } from "typebox";
import { parentDirOf, shellQuote } from "../dockerfile.ts";
import type { Instruction } from "../dockerfile.ts";
import { HttpUrl, StepMode, StepPath } from "./fields.ts";

export const DownloadStep = Type.Object(
  {
    type: Type.Literal("download"),
    url: HttpUrl,
    dest: StepPath,
    sha256: Type.Optional(Type.String({ pattern: "^[0-9a-f]{64}$" })),
    mode: Type.Optional(StepMode),
  },
  { additionalProperties: false },
);

export function download(step: Static<typeof DownloadStep>): Instruction[] {
  const dest = shellQuote(step.dest);
  const parts = [parentDirOf(step.dest), `curl -fsSL --retry 2 -o ${dest} -- ${shellQuote(step.url)}`];
  if (step.sha256) parts.push(`echo ${shellQuote(`${step.sha256}  ${step.dest}`)} | sha256sum -c -`);
  if (step.mode) parts.push(`chmod ${step.mode} ${dest}`);
  return [{ op: "RUN", script: parts.join(" && ") }];
}
