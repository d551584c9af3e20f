// `npm_install {packages, global?}`: npm packages into the working directory, or globally.

import { Type } from "typebox";
import type { Static } from "typebox";
import { shellQuote } from "../dockerfile.ts";
import type { Instruction } from "../dockerfile.ts";
import { Packages } from "./fields.ts";

export const NpmInstallStep = Type.Object(
  { type: Type.Literal("npm_install"), packages: Packages, global: Type.Optional(Type.Boolean()) },
  { additionalProperties: false },
);

export function npmInstall(step: Static<typeof NpmInstallStep>): Instruction[] {
  return [{ op: "RUN", script: `npm install --no-audit --no-fund${step.global ? " --global" : ""} ${step.packages.map(shellQuote).join(" ")}` }];
}
