// Bundles the guest agent (esbuild) for injection into machines, with the node-pty and xattr prebuilt binaries beside
// it: the bundle needs nothing from the project's node_modules at run time. agent.cjs is a small entry that turns the
// compile cache on and loads the agent, main.cjs; the agent is then started once, on the host, to fill that cache.

import { build } from "esbuild";
import { spawn } from "node:child_process";
import { copyFile, cp, mkdir, mkdtemp, readFile, rm } from "node:fs/promises";
import { request } from "node:http";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { XATTR_ADDON } from "./xattr-metadata.ts";
import { AGENT_COMPILE_CACHE_DIR, AGENT_ENTRY_FILE, AGENT_MAIN_FILE } from "./protocol.ts";

const require = createRequire(import.meta.url);

/** Directories whose files the bundle is made from; a change in any of them means a new bundle. */
export const AGENT_SOURCES = [import.meta.dirname];

export async function bundleAgent(outDir: string): Promise<void> {
  await rm(outDir, { recursive: true, force: true });
  await mkdir(outDir, { recursive: true });
  // CommonJS, not ESM: an ESM entry starts Node's ESM loader, and an ESM import of a built-in builds its namespace
  // by reading every export (`node:http`'s lazy getters load Node's whole bundled undici). Measured on this host, the
  // same agent as CommonJS took ≈ 8 ms less CPU to listen and 1.6 MiB less memory than as ESM.
  const cjs = {
    bundle: true,
    platform: "node",
    format: "cjs",
    target: "node24",
    logLevel: "warning",
    legalComments: "none",
    // The addon and the kernels are found beside the bundle's files.
    define: { "import.meta.dirname": "__dirname", "import.meta.url": "__kilnFileUrl" },
    banner: { js: "const __kilnFileUrl = require('node:url').pathToFileURL(__filename).href;" },
  } as const;
  await build({ ...cjs, banner: {}, entryPoints: [join(import.meta.dirname, "start.ts")], outfile: join(outDir, AGENT_ENTRY_FILE) });
  // One file: what only some requests need (terminals and ws, git, kernels, services) is in it but runs on first use.
  await build({ ...cjs, entryPoints: [join(import.meta.dirname, "main.ts")], outfile: join(outDir, AGENT_MAIN_FILE), external: ["@lydell/node-pty", "bufferutil", "utf-8-validate"] });
  // V8 keeps a module's source for as long as the module lives: ASCII, one byte a character; a single other character
  // anywhere (esbuild escapes those in strings, not in the comments it keeps) doubles it (≈ 240 KB per machine).
  const nonAscii = /[^\x00-\x7f]/.exec(await readFile(join(outDir, AGENT_MAIN_FILE), "latin1"));
  if (nonAscii) throw new Error(`the agent bundle has a non-ASCII character near ${JSON.stringify((await readFile(join(outDir, AGENT_MAIN_FILE), "utf8")).slice(Math.max(0, nonAscii.index - 40), nonAscii.index + 10))}`);
  // Code-interpreter kernels are processes of their own: the Node kernel is a second bundle, the Python bridge a
  // script the machine's python3 runs (both found beside the agent, in kernels/).
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
  await fillCompileCache(outDir);
}

/** Bounds of the cache-filling run: a start of the agent and one request. */
const FILL_START_MS = 60_000;
const FILL_EXIT_MS = 10_000;

/**
 * Starts the bundled agent once, with the Node binary the guest runtime copies (this process's, without its flags:
 * V8 accepts a cache only under the flags that made it), asks it for its health, and stops it: on its way out Node
 * writes the code of the agent into the compile cache beside it. It runs as the server's
 * user on a socket in a private temp dir, and serves nothing else.
 */
async function fillCompileCache(outDir: string): Promise<void> {
  const dir = await mkdtemp(join(tmpdir(), "kiln-agent-cache-"));
  const socket = join(dir, "agent.sock");
  const child = spawn(process.execPath, [join(outDir, AGENT_ENTRY_FILE), "--socket", socket], {
    stdio: ["ignore", "ignore", "pipe"],
    env: { PATH: "/usr/sbin:/usr/bin:/sbin:/bin", HOME: dir, LANG: "C.UTF-8", TMPDIR: dir },
  });
  let stderr = "";
  child.stderr!.on("data", (c: Buffer) => (stderr = (stderr + c.toString()).slice(-2000)));
  const exited = new Promise<number | null>((resolve) => child.once("exit", (code) => resolve(code)));
  try {
    const deadline = Date.now() + FILL_START_MS;
    while (!(await healthy(socket))) {
      if (child.exitCode !== null || Date.now() > deadline) throw new Error(`the agent bundle did not start to fill its compile cache: ${stderr.trim() || `exit ${child.exitCode}`}`);
      await new Promise((r) => setTimeout(r, 10));
    }
    child.kill("SIGTERM");
    const timer = setTimeout(() => child.kill("SIGKILL"), FILL_EXIT_MS);
    const code = await exited;
    clearTimeout(timer);
    if (code !== 0) throw new Error(`the agent bundle did not stop cleanly after filling its compile cache: ${stderr.trim() || `exit ${code}`}`);
  } finally {
    if (child.exitCode === null) child.kill("SIGKILL");
    await rm(dir, { recursive: true, force: true });
  }
  await mkdir(join(outDir, AGENT_COMPILE_CACHE_DIR), { recursive: true });
}

function healthy(socketPath: string): Promise<boolean> {
  return new Promise((resolve) => {
    const req = request({ socketPath, path: "/health", timeout: 5_000 }, (res) => {
      res.resume();
      res.once("end", () => resolve(res.statusCode === 200));
    });
    req.once("timeout", () => req.destroy());
    req.once("error", () => resolve(false));
    req.end();
  });
}
