// Which images a user's Dockerfile pulls, read off its FROM lines and `--from=` flags without interpreting
// anything else: enough to match registry credentials to hosts and to apply SPEC.md's rules for authenticated builds.

export interface DockerfileImages {
  /** FROM operands in order, with the stage alias each defines (lower-cased) if any. */
  froms: { image: string; alias?: string; line: number }[];
  /** `COPY --from=…` / `RUN --mount=…,from=…` operands that are not stage aliases or indexes: images pulled implicitly. */
  implicit: { image: string; line: number }[];
}

/** Logical lines: comments dropped, backslash continuations joined (the default escape character). */
function logicalLines(text: string): { text: string; line: number }[] {
  const out: { text: string; line: number }[] = [];
  let buf = "";
  let start = 0;
  const raw = text.split(/\r?\n/);
  for (let i = 0; i < raw.length; i++) {
    const l = raw[i];
    if (!buf && /^\s*#/.test(l)) continue;
    if (!buf) start = i + 1;
    if (/\\\s*$/.test(l)) {
      buf += l.replace(/\\\s*$/, " ");
      continue;
    }
    buf += l;
    if (buf.trim()) out.push({ text: buf.trim(), line: start });
    buf = "";
  }
  if (buf.trim()) out.push({ text: buf.trim(), line: start });
  return out;
}

export function dockerfileImages(text: string): DockerfileImages {
  const froms: DockerfileImages["froms"] = [];
  const implicit: DockerfileImages["implicit"] = [];
  const aliases = new Set<string>();
  for (const { text: l, line } of logicalLines(text)) {
    const words = l.split(/\s+/);
    const instr = words[0].toUpperCase();
    if (instr === "FROM") {
      const args = words.slice(1).filter((w) => !w.startsWith("--"));
      const image = args[0] ?? "";
      const alias = args[1]?.toUpperCase() === "AS" && args[2] ? args[2].toLowerCase() : undefined;
      froms.push({ image, alias, line });
      if (alias) aliases.add(alias);
      continue;
    }
    const from: string[] = [];
    for (const w of words.slice(1)) {
      const copy = /^--from=(.+)$/.exec(w);
      if (copy && (instr === "COPY" || instr === "ADD")) from.push(copy[1]);
      const mount = /^--mount=(.+)$/.exec(w);
      if (mount && instr === "RUN") for (const kv of mount[1].split(",")) if (kv.startsWith("from=")) from.push(kv.slice(5));
    }
    for (const f of from) {
      const name = f.replace(/^["']|["']$/g, "");
      if (!aliases.has(name.toLowerCase()) && !/^\d+$/.test(name)) implicit.push({ image: name, line });
    }
  }
  return { froms, implicit };
}

/** The FROM operands that name images (not earlier stages, not `scratch`). */
export function externalFroms(images: DockerfileImages): DockerfileImages["froms"] {
  const seen = new Set<string>();
  const out: DockerfileImages["froms"] = [];
  for (const f of images.froms) {
    if (seen.has(f.image.toLowerCase()) || f.image.toLowerCase() === "scratch") {
      if (f.alias) seen.add(f.alias);
      continue;
    }
    out.push(f);
    if (f.alias) seen.add(f.alias);
  }
  return out;
}

/**
 * The image the built stage (the last, or `target`) finally stands on, following stage aliases down to a FROM that
 * names an image: null for `scratch`, a variable, or a stage that cannot be found.
 */
export function finalStageBase(images: DockerfileImages, target?: string): string | null {
  const { froms } = images;
  let at = target ? froms.findIndex((f) => f.alias === target.toLowerCase()) : froms.length - 1;
  for (let hops = 0; at >= 0 && hops <= froms.length; hops++) {
    const image = froms[at]!.image;
    // An earlier stage by alias (or by index) is followed; anything else is the image itself.
    const byAlias = froms.slice(0, at).findLastIndex((f) => f.alias === image.toLowerCase());
    const byIndex = /^\d+$/.test(image) && Number(image) < at ? Number(image) : -1;
    const next = byAlias >= 0 ? byAlias : byIndex;
    if (next < 0) return image.toLowerCase() === "scratch" || image.includes("$") ? null : image;
    at = next;
  }
  return null;
}
