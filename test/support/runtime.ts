// The OCI runtime a test run drives (KILN_OCI_RUNTIME, runc by default) and why driver tests cannot run here, if so.

import { execFileSync } from "node:child_process";

export const runtime = (process.env.KILN_OCI_RUNTIME as "runc" | "runsc" | undefined) ?? "runc";

/** Why tests that drive the OCI driver directly are skipped on this host (undefined: they run). */
export function driverSkipReason(): string | undefined {
  if (process.getuid?.() !== 0) return "the oci driver needs root (mounts, user namespaces, cgroups)";
  try {
    execFileSync(runtime, ["--version"], { stdio: "ignore" });
  } catch {
    return `${runtime} is not installed`;
  }
  return undefined;
}
