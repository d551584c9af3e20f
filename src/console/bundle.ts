// Builds the web console (console/: Preact + xterm.js) into dist/console with esbuild: hashed, minified assets and
// an index.html that names them. Run at install (`npm run build:console`, scripts/up.sh) and by the test command.

import { build } from "esbuild";
import { mkdir, readFile, rename, rm, writeFile } from "node:fs/promises";
import { basename, join, relative } from "node:path";

export const CONSOLE_SOURCE_DIR = join(import.meta.dirname, "..", "..", "console");
export const CONSOLE_DIST_DIR = join(import.meta.dirname, "..", "..", "dist", "console");
/** Where index.html puts the per-response CSP nonce (routes.ts fills it in). */
export const NONCE_PLACEHOLDER = "__KILN_CSP_NONCE__";

export async function buildConsole(outDir = CONSOLE_DIST_DIR): Promise<{ script: string; style: string }> {
  // Built beside the old bundle and swapped in whole, so a server serving the old one never sees half a new one.
  const staging = `${outDir}.building-${process.pid}`;
  await rm(staging, { recursive: true, force: true });
  await mkdir(join(staging, "assets"), { recursive: true });
  const result = await build({
    entryPoints: [join(CONSOLE_SOURCE_DIR, "src", "main.tsx")],
    outdir: join(staging, "assets"),
    entryNames: "[name]-[hash]",
    chunkNames: "[name]-[hash]",
    assetNames: "[name]-[hash]",
    splitting: true,
    bundle: true,
    format: "esm",
    platform: "browser",
    target: ["chrome120", "firefox120", "safari17"],
    jsx: "automatic",
    jsxImportSource: "preact",
    minify: true,
    sourcemap: false,
    legalComments: "none",
    metafile: true,
    logLevel: "warning",
  });
  const outputs = Object.keys(result.metafile.outputs).map((p) => basename(p));
  const entry = Object.entries(result.metafile.outputs).find(([, o]) => o.entryPoint !== undefined && o.entryPoint.endsWith("main.tsx"));
  const script = entry ? basename(entry[0]) : undefined;
  const style = entry?.[1].cssBundle ? basename(entry[1].cssBundle) : undefined;
  if (!script || !style) throw new Error(`the console bundle is missing its ${script ? "stylesheet" : "script"} (${outputs.join(", ")})`);
  // Chunks the entry imports statically are announced up front, so they load beside it rather than after it.
  const preloads = (entry?.[1].imports ?? []).filter((i) => i.kind === "import-statement").map((i) => `<link rel="modulepreload" href="/console/assets/${basename(i.path)}">`);
  const template = await readFile(join(CONSOLE_SOURCE_DIR, "index.html"), "utf8");
  const html = template
    .replaceAll("{{script}}", `/console/assets/${script}`)
    .replaceAll("{{style}}", `/console/assets/${style}`)
    .replaceAll("{{preloads}}", preloads.join("\n"));
  if (!html.includes(NONCE_PLACEHOLDER)) throw new Error(`console/index.html must carry ${NONCE_PLACEHOLDER}`);
  await writeFile(join(staging, "index.html"), html);
  const old = `${outDir}.old-${process.pid}`;
  await rm(old, { recursive: true, force: true });
  await rename(outDir, old).catch((err: NodeJS.ErrnoException) => {
    if (err.code !== "ENOENT") throw err;
  });
  await rename(staging, outDir);
  await rm(old, { recursive: true, force: true });
  return { script: relative(outDir, join(outDir, "assets", script)), style: relative(outDir, join(outDir, "assets", style)) };
}
