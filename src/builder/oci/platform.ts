// Which manifest of an image index a machine on this host can run, by SPEC.md's rule: an exact Linux variant for
// the host architecture first (amd64/v1, arm64/v8, arm64/v8.0), then a variantless Linux manifest; a manifest
// that needs os.version or os.features is refused, never silently skipped.

import { importError } from "./types.ts";

export interface PlatformDescriptor {
  digest: string;
  mediaType?: string;
  platform?: { os?: string; architecture?: string; variant?: string; "os.version"?: string; "os.features"?: string[] };
}

const ARCH: Record<string, string> = { x64: "amd64", arm64: "arm64" };
const EXACT_VARIANTS: Record<string, string[]> = { amd64: ["v1"], arm64: ["v8", "v8.0"] };

export function hostArchitecture(nodeArch: string = process.arch): string {
  const arch = ARCH[nodeArch];
  if (!arch) throw importError(`this host's architecture (${nodeArch}) cannot run imported images`);
  return arch;
}

/** The descriptor to pull from an index's `manifests`, or a build_error naming which manifest and why. */
export function selectPlatform(manifests: PlatformDescriptor[], arch: string = hostArchitecture()): PlatformDescriptor {
  const linux = manifests.filter((m) => m.platform?.os === "linux" && m.platform.architecture === arch);
  const exact = linux.find((m) => EXACT_VARIANTS[arch]?.includes(m.platform?.variant ?? ""));
  const variantless = linux.find((m) => !m.platform?.variant);
  const chosen = exact ?? variantless;
  if (!chosen) {
    const offered = manifests.map((m) => [m.platform?.os, m.platform?.architecture, m.platform?.variant].filter(Boolean).join("/") || "unknown").join(", ");
    throw importError(`the image index has no manifest for linux/${arch} (${EXACT_VARIANTS[arch]?.join(", ") ?? ""} or no variant); it offers: ${offered || "nothing"}`);
  }
  rejectOsRequirements(chosen.platform ?? {}, `manifest ${chosen.digest}`);
  return chosen;
}

/** Images that need a particular OS build or OS features (Windows-style requirements) are refused outright. */
export function rejectOsRequirements(p: { "os.version"?: string; "os.features"?: string[]; os?: string }, what: string): void {
  const plat = [p.os].filter(Boolean).join("/");
  if (p["os.version"]) throw importError(`${what}${plat ? ` (${plat})` : ""} is unsupported: it requires os.version ${JSON.stringify(p["os.version"])}`);
  if (Array.isArray(p["os.features"]) && p["os.features"].length > 0) {
    throw importError(`${what}${plat ? ` (${plat})` : ""} is unsupported: it requires os.features ${JSON.stringify(p["os.features"])}`);
  }
}
