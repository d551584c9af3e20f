// Bundles the guest agent into one file (esbuild) for injection into machines, with the node-pty and xattr prebuilt
// binaries beside it: the bundle needs nothing from the project's node_modules at run time.

import { build } from "esbuild";
import type { Plugin } from "esbuild";
import { copyFile, cp, mkdir, rm } from "node:fs/promises";
import { builtinModules, createRequire } from "node:module";
import { dirname, join } from "node:path";
import { XATTR_ADDON } from "./xattr-metadata.ts";

const require = createRequire(import.meta.url);

/** Directories whose files the bundle is made from; a change in any of them means a new bundle. */
export const AGENT_SOURCES = [import.meta.dirname];

/**
 * Node's built-in modules loaded with `require`, not `import`. An ESM import of a built-in builds its module namespace
 * by reading every export, lazy getters included: `node:http`'s (WebSocket, fetch's classes) load Node's whole
 * bundled undici. Measured on this host, that made the agent listen 130–420 ms after its start instead of ≈ 40 ms,
 * and every machine's boot (a fork's child above all) waited for it. Through `require` the getters stay lazy.
 */
const builtinsByRequire: Plugin = {
  name: "builtins-by-require",
  setup(b) {
    const builtin = new RegExp(`^(node:)?(${builtinModules.map((m) => m.replace(/[/]/g, "\\/")).join("|")})$`);
    b.onResolve({ filter: builtin }, (args) => (args.namespace === "builtin-require" ? { path: args.path, external: true } : { path: args.path, namespace: "builtin-require" }));
    b.onLoad({ filter: /.*/, namespace: "builtin-require" }, (args) => ({ contents: `module.exports = require(${JSON.stringify(args.path)});`, loader: "js" }));
  },
};

export async function bundleAgent(outDir: string): Promise<void> {
  await rm(outDir, { recursive: true, force: true });
  await mkdir(outDir, { recursive: true });
  await build({
    entryPoints: [join(import.meta.dirname, "main.ts")],
    outfile: join(outDir, "agent.mjs"),
    bundle: true,
    platform: "node",
    format: "esm",
    target: "node24",
    external: ["@lydell/node-pty", "bufferutil", "utf-8-validate"],
    plugins: [builtinsByRequire],
    banner: { js: "import { createRequire as __kilnCreateRequire } from 'node:module'; const require = __kilnCreateRequire(import.meta.url);" },
    logLevel: "warning",
    legalComments: "none",
  });
  // Code-interpreter kernels are processes of their own: the Node kernel is a second bundle, the Python bridge a
  // script the machine's python3 runs (both found beside agent.mjs, in kernels/).
  await build({
    entryPoints: [join(import.meta.dirname, "kernels", "js-kernel.ts")],
    outfile: join(outDir, "kernels", "js-kernel.mjs"),
    bundle: true,
    platform: "node",
    format: "esm",
    target: "node24",
    logLevel: "warning",
    legalComments: "none",
  });
  await copyFile(join(import.meta.dirname, "kernels", "python_bridge.py"), join(outDir, "kernels", "python_bridge.py"));
  await copyFile(join(import.meta.dirname, "kernels", "python_kernel.py"), join(outDir, "kernels", "python_kernel.py"));
  for (const pkg of ["@lydell/node-pty", "@lydell/node-pty-linux-x64"]) {
    const from = dirname(require.resolve(`${pkg}/package.json`));
    await cp(from, join(outDir, "node_modules", pkg), { recursive: true, filter: (src) => !/\.(md|d\.ts|map)$/.test(src) });
  }
  // The xattr addon alone (glibc, as the guest runtime's node): loaded by path, never through its package's loader.
  const xattrPkg = dirname(require.resolve(`@napi-rs/xattr-linux-${process.arch}-gnu/package.json`));
  await mkdir(dirname(join(outDir, XATTR_ADDON)), { recursive: true });
  await copyFile(join(xattrPkg, `xattr.linux-${process.arch}-gnu.node`), join(outDir, XATTR_ADDON));
}
