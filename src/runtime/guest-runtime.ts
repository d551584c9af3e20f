// The runtime Kiln injects read-only at /opt/kiln in every machine: the Node binary the server runs on, its
// dynamic loader and shared libraries (so Alpine or distroless roots work), tini as pid 1, and the agent bundle.

import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, readdirSync, statSync } from "node:fs";
import { chmod, copyFile, mkdir, readFile, readdir, rename, rm, stat, writeFile } from "node:fs/promises";
import { basename, join } from "node:path";

/** The loader's name inside /opt/kiln/lib; the machine's first process runs node through it. */
export const GUEST_LOADER = process.arch === "arm64" ? "ld-linux-aarch64.so.1" : "ld-linux-x86-64.so.2";

/**
 * Copies of tini and the loader that machine users may execute but not read (0711, owned by host root, which no
 * machine maps). Linux marks a process that execs a file its caller cannot read as not dumpable (fs/exec.c
 * would_dump) and ties its mm to the first user namespace privileged over that file — the host's. So the machine's
 * first process and its agent, started from these, cannot be ptraced, pidfd_getfd'd or read through /proc by
 * anything in the machine, even by a machine root with every capability in its own namespace. gVisor refuses to
 * exec a file it cannot read, so runsc machines start from the readable ones (the agent drops dumpability itself,
 * see agent/nodump.ts).
 */
export const EXEC_ONLY_DIR = "exec-only";
export const EXEC_ONLY_TINI = `${EXEC_ONLY_DIR}/tini`;
export const EXEC_ONLY_LOADER = `${EXEC_ONLY_DIR}/ld.so`;

/** Bump when the layout below changes, so every host rebuilds its runtime. */
const RECIPE = "guest-runtime-5"; // 5: exec-only dir searchable under the server's 077 umask
/** Versions kept beside the current one: machines still running on an older runtime keep their files. */
const KEEP_OLD_VERSIONS = 2;
/** tini must be static: it is pid 1 in roots whose libc (if any) is not ours. */
const TINI_STATIC = "/usr/bin/tini-static";

/** Shared libraries (and the loader) a binary needs, from ldd. */
function sharedLibraries(binary: string): { loader: string; libs: string[] } {
  const out = execFileSync("ldd", [binary], { encoding: "utf8" });
  let loader = "";
  const libs: string[] = [];
  for (const line of out.split("\n")) {
    const arrow = /=>\s+(\/\S+)/.exec(line);
    if (arrow) libs.push(arrow[1]);
    else {
      const direct = /^\s*(\/\S*ld-linux\S*)/.exec(line);
      if (direct) loader = direct[1];
    }
  }
  if (!loader) throw new Error(`could not find the dynamic loader of ${binary} in ldd output`);
  return { loader, libs };
}

function nativeAddons(dir: string): string[] {
  const found: string[] = [];
  for (const e of readdirSync(dir, { withFileTypes: true, recursive: true })) if (e.isFile() && e.name.endsWith(".node")) found.push(join(e.parentPath, e.name));
  return found;
}

/** Cheap identity of the inputs (size and mtime, not content): a restart with nothing changed costs a few stats. */
function fingerprint(paths: string[]): string {
  const h = createHash("sha256").update(RECIPE + "\n");
  const walk = (p: string) => {
    const st = statSync(p);
    if (st.isDirectory()) for (const n of readdirSync(p).sort()) walk(join(p, n));
    else h.update(`${p}:${st.size}:${st.mtimeMs}\n`);
  };
  for (const p of paths) walk(p);
  return h.digest("hex").slice(0, 16);
}

/**
 * Makes (or finds) the runtime under `dir/<version>` and returns that path. Each version is written aside and
 * renamed into place, so a half-made runtime is never mounted, and a rebuild never pulls files from under
 * machines that are still running on the previous one.
 */
export async function prepareGuestRuntime(opts: { dir: string; agentBundle: (outDir: string) => Promise<void>; agentSources?: string[] }): Promise<string> {
  const node = process.execPath;
  if (!existsSync(TINI_STATIC)) throw new Error(`${TINI_STATIC} is missing (apt-get install tini): machines run it as their first process`);
  const version = fingerprint([node, TINI_STATIC, ...(opts.agentSources ?? [])]);
  const target = join(opts.dir, version);
  if (existsSync(join(target, "stamp"))) return target;

  await mkdir(opts.dir, { recursive: true });
  const work = join(opts.dir, `.tmp-${version}-${process.pid}`);
  await rm(work, { recursive: true, force: true });
  try {
    await mkdir(join(work, "bin"), { recursive: true });
    await mkdir(join(work, "lib"), { recursive: true });
    await copyFile(node, join(work, "bin", "node"));
    await copyFile(TINI_STATIC, join(work, "bin", "tini"));
    const { loader, libs } = sharedLibraries(node);
    await copyFile(loader, join(work, "lib", GUEST_LOADER));
    for (const lib of libs) await copyFile(lib, join(work, "lib", basename(lib)));
    await opts.agentBundle(join(work, "agent"));
    // The agent's native addons (node-pty's pty.node needs libutil) load their libraries from here too: an
    // imported image may have no libc at all, or one that is not ours.
    for (const addon of nativeAddons(join(work, "agent"))) {
      for (const lib of sharedLibraries(addon).libs) if (!existsSync(join(work, "lib", basename(lib)))) await copyFile(lib, join(work, "lib", basename(lib)));
    }
    // Machine users are unprivileged host uids: everything must be world-readable, nothing writable but by host root.
    execFileSync("chmod", ["-R", "a+rX,go-w", work]);
    for (const exe of ["bin/node", "bin/tini", `lib/${GUEST_LOADER}`]) await chmod(join(work, exe), 0o755);
    await mkdir(join(work, EXEC_ONLY_DIR));
    await chmod(join(work, EXEC_ONLY_DIR), 0o755); // explicit: the server's umask is 077
    await copyFile(TINI_STATIC, join(work, EXEC_ONLY_TINI));
    await copyFile(loader, join(work, EXEC_ONLY_LOADER));
    for (const exe of [EXEC_ONLY_TINI, EXEC_ONLY_LOADER]) await chmod(join(work, exe), 0o711);
    await writeFile(join(work, "stamp"), JSON.stringify({ version, node: process.version, made_at: new Date().toISOString() }));
    await rename(work, target);
  } catch (err) {
    await rm(work, { recursive: true, force: true });
    // Another Kiln process sharing this cache made the same version first: use theirs.
    if (existsSync(join(target, "stamp"))) return target;
    throw err;
  }
  await pruneOldVersions(opts.dir, version);
  return target;
}

async function pruneOldVersions(dir: string, current: string) {
  const versions: { name: string; mtime: number }[] = [];
  for (const name of await readdir(dir)) {
    if (name === current || name.startsWith(".tmp-")) continue;
    const st = await stat(join(dir, name)).catch(() => undefined);
    // Files at the top level are the pre-versioned layout: not mounted by anything new, removed.
    if (st && !st.isDirectory()) await rm(join(dir, name), { force: true });
    else if (st && existsSync(join(dir, name, "stamp"))) versions.push({ name, mtime: st.mtimeMs });
    else if (st && ["bin", "lib", "agent"].includes(name)) await rm(join(dir, name), { recursive: true, force: true });
  }
  versions.sort((a, b) => b.mtime - a.mtime);
  for (const v of versions.slice(KEEP_OLD_VERSIONS)) await rm(join(dir, v.name), { recursive: true, force: true });
}

/** True when `dir` holds a complete runtime (used by the driver's readiness check). */
export async function guestRuntimeComplete(dir: string): Promise<boolean> {
  return (await readFile(join(dir, "stamp"), "utf8").catch(() => "")) !== "";
}
