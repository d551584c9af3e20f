// The data dir is private: Kiln writes everything with umask 077 (store, WAL, secrets, disk images, logs, caches,
// build scratch), and at start tightens what an older Kiln (or another umask) left readable.
//
// "Private" has one deliberate opening: machine root is an unprivileged host uid (and gVisor's gofer opens bind
// sources as one), and both must walk down to their own root filesystem and mounts. So the data dir and the few
// directories on those paths (machines/, volumes/, the cache and its guest runtime) are 0711 — searchable, never
// listable — while every machine's and volume's own directory is 0710 for the machines' group only, and every file
// and every other directory is 0600/0700. docs/security/api.md lists what is where.

import { chmod, chown, lstat, mkdir, readdir } from "node:fs/promises";
import type { Stats } from "node:fs";
import { join, relative, isAbsolute } from "node:path";
import { HOST_ID_BASE } from "./runtime/oci/idmap.ts";

/** What Kiln creates: owner-only. Set once per process, before anything is written. */
export const KILN_UMASK = 0o077;

/** Directories directly in the data dir that machines (gVisor's gofer, a Dockerfile RUN step) must pass through: search-only for others. */
export const TRAVERSED_DIRS = ["machines", "volumes", "cache", "builder"] as const;
/** Per-machine and per-volume directories: only root and the machines' group (machine root's host gid) may enter. */
export const MACHINE_DIR_MODE = 0o710;
export const MACHINE_GROUP = HOST_ID_BASE;
/** Where machines' disk images and snapshots are (runtime/oci/disk-pool.ts): root's only. */
export const DISK_POOL_DIR = "disks";
/** The cache's guest runtime directory (app.ts prepares it there). */
export const GUEST_RUNTIME_DIR = "guest-runtime";

export function usePrivateUmask(): void {
  process.umask(KILN_UMASK);
}

/** chmod to `mode` only when the mode differs (a no-op start touches nothing). */
async function ensureMode(path: string, st: Stats, mode: number): Promise<void> {
  if ((st.mode & 0o7777) !== mode) await chmod(path, mode);
}

/** Regular files lose every group/other bit; other directories become 0700 (their content is then out of reach). */
async function tightenEntry(path: string, st: Stats): Promise<void> {
  if (st.isFile()) await ensureMode(path, st, st.mode & 0o7700);
  else if (st.isDirectory()) await ensureMode(path, st, 0o700);
}

/** The entries of a machine's or a volume's own directory: files private, subdirectories left to their owner. */
async function tightenOwnDir(dir: string): Promise<void> {
  const st = await lstat(dir);
  if (!st.isDirectory()) return;
  // A root-group dir (an older Kiln's 0711) gets the machines' group; a group the driver chose is left as it is.
  if (st.uid !== 0 || st.gid === 0) await chown(dir, 0, st.gid === 0 ? MACHINE_GROUP : st.gid);
  await ensureMode(dir, st, MACHINE_DIR_MODE);
  await tightenFiles(dir, st.dev);
  // A machine's disk dir holds its disk image; the machine reaches the image's contents only through its root mount.
  const disk = join(dir, "disk");
  const dst = await lstat(disk).catch(() => undefined);
  if (dst?.isDirectory() && dst.dev === st.dev) {
    await ensureMode(disk, dst, 0o700);
    await tightenFiles(disk, dst.dev);
  }
}

/** Regular files directly in `dir` (not mount points: a netns file or a bind target is another filesystem's) lose group/other bits. */
async function tightenFiles(dir: string, dev: number): Promise<void> {
  for (const name of await readdir(dir)) {
    const p = join(dir, name);
    const e = await lstat(p);
    // Logs, specs, pid files, disk and volume images: nothing in them is the machine's to read through the host.
    if (e.isFile() && e.dev === dev) await ensureMode(p, e, e.mode & 0o7700);
  }
}

/**
 * Creates the data dir private and tightens an existing one: the data dir and TRAVERSED_DIRS 0711, each machine and
 * volume dir 0710 root:MACHINE_GROUP with its files 0600, every other entry 0600/0700; the cache likewise when it is
 * inside the data dir. Never recurses into a layer, a root filesystem or a mounted volume: their modes are the
 * machines' own.
 */
export async function preparePrivateDataDir(dataDir: string, cacheDir: string): Promise<void> {
  await mkdir(dataDir, { recursive: true, mode: 0o711 });
  await chmod(dataDir, 0o711);
  for (const name of await readdir(dataDir)) {
    const p = join(dataDir, name);
    const st = await lstat(p);
    if (st.isSymbolicLink()) continue;
    if ((TRAVERSED_DIRS as readonly string[]).includes(name) && st.isDirectory()) {
      await ensureMode(p, st, 0o711);
      if (name === "machines" || name === "volumes") for (const id of await readdir(p)) await tightenOwnDir(join(p, id));
    } else await tightenEntry(p, st);
    // The disk pool (its own filesystem when an XFS file is mounted there): machines' and spare disks' images private too.
    if (name === DISK_POOL_DIR && st.isDirectory()) {
      for (const sub of ["machines", "stock"]) {
        const d = join(p, sub);
        const dst = await lstat(d).catch(() => undefined);
        if (dst?.isDirectory()) await tightenFiles(d, dst.dev);
      }
    }
  }
  // The cache: inside the data dir (the default) it is tightened like the rest; elsewhere (KILN_CACHE_DIR, which
  // other servers or tools may share) only its root is made search-only and what Kiln writes there is private (umask).
  await mkdir(cacheDir, { recursive: true });
  const rel = relative(dataDir, cacheDir);
  const inside = rel !== "" && !rel.startsWith("..") && !isAbsolute(rel);
  await chmod(cacheDir, 0o711);
  // The guest runtime (Node, the agent bundle, tini: nothing secret) is bind-mounted into every machine.
  const guestRuntime = join(cacheDir, GUEST_RUNTIME_DIR);
  await mkdir(guestRuntime, { recursive: true });
  await chmod(guestRuntime, 0o711);
  if (!inside) return;
  for (const name of await readdir(cacheDir)) {
    if (name === GUEST_RUNTIME_DIR) continue;
    const p = join(cacheDir, name);
    const st = await lstat(p);
    if (st.isDirectory()) await ensureMode(p, st, 0o700);
    else if (st.isFile()) await ensureMode(p, st, st.mode & 0o7700);
  }
}
