// `pip_install {packages}`: Python packages into the image's python3 (PIP_INDEX_URL and friends may come from
// build_envs, so a private index's address never lands in the template).

import { Type } from "typebox";
import type { Static } from "typebox";
import { shellQuote } from "../dockerfile.ts";
import type { Instruction } from "../dockerfile.ts";
import { Packages } from "./fields.ts";

export const PipInstallStep = Type.Object({ type: Type.Literal("pip_install"), packages: Packages }, { additionalProperties: false });

export function pipInstall(step: Static<typeof PipInstallStep>): Instruction[] {
  return [{ op: "RUN", script: `python3 -m pip install --no-cache-dir --break-system-packages --disable-pip-version-check ${step.packages.map(shellQuote).join(" ")}` }];
}
