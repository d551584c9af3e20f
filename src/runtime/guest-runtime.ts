// The runtime Kiln injects read-only at /opt/kiln in every machine: the Node binary the server runs on, its
// dynamic loader and shared libraries (so Alpine or distroless roots work), tini as pid 1, and the agent bundle.
// Rebuilt only when its inputs change; written aside and renamed so a half-made runtime is never mounted.

import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, readdirSync, statSync } from "node:fs";
import { copyFile, mkdir, readFile, rename, rm, writeFile, chmod } from "node:fs/promises";
import { basename, join } from "node:path";

const TINI = ["/usr/bin/tini-static", "/usr/bin/tini"];

/** Shared libraries (and the loader) a binary needs, from ldd. */
function sharedLibraries(binary: string): { loader: string; libs: string[] } {
  const out = execFileSync("ldd", [binary], { encoding: "utf8" });
  let loader = "";
  const libs: string[] = [];
  for (const line of out.split("\n")) {
    const arrow = /=>\s+(\/\S+)/.exec(line);
    if (arrow) libs.push(arrow[1]);
    else {
      const direct = /^\s*(\/\S+ld-linux\S*)/.exec(line);
      if (direct) loader = direct[1];
    }
  }
  if (!loader) throw new Error(`could not find the dynamic loader of ${binary} in ldd output`);
  return { loader, libs };
}

function fingerprint(paths: string[]): string {
  const h = createHash("sha256");
  const walk = (p: string) => {
    const st = statSync(p);
    if (st.isDirectory()) for (const n of readdirSync(p).sort()) walk(join(p, n));
    else h.update(`${p}:${st.size}:${st.mtimeMs}\n`);
  };
  for (const p of paths) walk(p);
  return h.digest("hex");
}

export async function prepareGuestRuntime(opts: { dir: string; agentBundle: (outDir: string) => Promise<void>; agentSources?: string[] }): Promise<string> {
  const node = process.execPath;
  const tini = TINI.find((p) => existsSync(p));
  if (!tini) throw new Error("tini is not installed (apt-get install tini): machines need it as their first process");
  const stamp = fingerprint([node, tini, ...(opts.agentSources ?? [])]);
  const stampFile = join(opts.dir, "stamp");
  if (existsSync(stampFile) && (await readFile(stampFile, "utf8")) === stamp) return opts.dir;

  const work = `${opts.dir}.tmp-${process.pid}`;
  await rm(work, { recursive: true, force: true });
  await mkdir(join(work, "bin"), { recursive: true });
  await mkdir(join(work, "lib"), { recursive: true });
  await copyFile(node, join(work, "bin", "node"));
  await copyFile(tini, join(work, "bin", "tini"));
  const { loader, libs } = sharedLibraries(node);
  await copyFile(loader, join(work, "lib", "ld-linux.so"));
  for (const lib of libs) await copyFile(lib, join(work, "lib", basename(lib)));
  await opts.agentBundle(join(work, "agent"));
  await writeFile(join(work, "stamp"), stamp);
  execFileSync("chmod", ["-R", "a+rX,go-w", work]);
  await chmod(join(work, "bin", "node"), 0o755);
  await chmod(join(work, "bin", "tini"), 0o755);
  await chmod(join(work, "lib", "ld-linux.so"), 0o755);
  await rm(opts.dir, { recursive: true, force: true });
  try {
    await rename(work, opts.dir);
  } catch (err) {
    // Another Kiln process sharing this cache finished first: use theirs if it is the same runtime.
    await rm(work, { recursive: true, force: true });
    if (!existsSync(stampFile) || (await readFile(stampFile, "utf8")) !== stamp) throw err;
  }
  return opts.dir;
}
