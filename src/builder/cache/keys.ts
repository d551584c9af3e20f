// Cache keys of the three tiers. A layer's key chains its parent's, so changing step k changes every key after it
// and none before; the final-artifact key covers everything that shapes the template. No secret is ever an input.

import { createHash } from "node:crypto";

function digestOf(parts: string[]): string {
  const h = createHash("sha256");
  for (const p of parts) h.update(String(Buffer.byteLength(p))).update(":").update(p).update("\n");
  return "sha256:" + h.digest("hex");
}

/** Key of one step's layer: the parent layer's key (or the source's digest), the step's text, its inputs' digests. */
export function layerKey(parentKey: string, stepText: string, inputDigests: string[]): string {
  return digestOf(["layer/v1", parentKey, stepText, ...inputDigests]);
}

/** Digest of the whole build input; an artifact built from the same one is reused without running a step. */
export function sourceDigest(input: { sourceDigest: string; dockerfile: string; contextDigest: string; startCmd?: string; readyCmd?: string; runtimeDefaults?: unknown }): string {
  return digestOf(["final/v1", input.sourceDigest, input.dockerfile, input.contextDigest, input.startCmd ?? "", input.readyCmd ?? "", canonicalJson(input.runtimeDefaults ?? null)]);
}

/** Digest of the context manifest: every file's path, content digest and mode, in path order. */
export function contextDigest(files: { path: string; sha256: string; mode?: string }[]): string {
  const sorted = [...files].sort((a, b) => (a.path < b.path ? -1 : a.path > b.path ? 1 : 0));
  return digestOf(["context/v1", ...sorted.map((f) => `${f.path}\0${f.sha256}\0${f.mode ?? ""}`)]);
}

/** JSON with object keys sorted, so equal values give equal bytes. */
export function canonicalJson(v: unknown): string {
  if (Array.isArray(v)) return `[${v.map(canonicalJson).join(",")}]`;
  if (v && typeof v === "object") {
    const o = v as Record<string, unknown>;
    return `{${Object.keys(o).sort().filter((k) => o[k] !== undefined).map((k) => `${JSON.stringify(k)}:${canonicalJson(o[k])}`).join(",")}}`;
  }
  return JSON.stringify(v);
}
