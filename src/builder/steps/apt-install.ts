// `apt_install {packages}`: Debian packages from the mirror the image is configured with, lists removed after.

import { Type } from "typebox";
import type { Static } from "typebox";
import { asUser, shellQuote } from "../dockerfile.ts";
import type { Instruction, StepState } from "../dockerfile.ts";
import { Packages } from "./fields.ts";

export const AptInstallStep = Type.Object({ type: Type.Literal("apt_install"), packages: Packages }, { additionalProperties: false });

export function aptInstall(step: Static<typeof AptInstallStep>, state: StepState): Instruction[] {
  const script =
    "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends " +
    step.packages.map(shellQuote).join(" ") +
    " && rm -rf /var/lib/apt/lists/*";
  return asUser("root", state, [{ op: "RUN", script }]);
}
