// Where machines' disk images and snapshots live: a filesystem that can reflink (share a file's blocks in one
// ioctl), so a snapshot or a fork of a machine's 10 GiB disk costs milliseconds whatever it holds.
//
// The data dir's own filesystem is used when it can reflink (XFS, btrfs). Otherwise (ext4, as on these hosts) the
// pool is a sparse XFS file in the data dir, formatted with reflink and loop-mounted at `<data>/disks`; a plain copy
// (cost: the bytes the disk holds) is the fallback where neither works. docs/snapshots.md has the measurements.

import { execHost } from "../host-commands.ts";
import { existsSync, readFileSync } from "node:fs";
import { chmod, mkdir, readdir, rm, statfs, truncate, writeFile } from "node:fs/promises";
import { join } from "node:path";
import type { Logger } from "../../log.ts";
import { isMounted, mountSource } from "./mounts.ts";

// Started by the host command helper, not by the server's own thread (host-commands.ts).
const exec = execHost;
const GIB = 1024 * 1024 * 1024;
/** The XFS pool's size when the data dir's filesystem is smaller than this (it is sparse: size is only a ceiling). */
const MIN_POOL_BYTES = 16 * GIB;

export type DiskPoolMode = "auto" | "off";

export interface DiskPool {
  /** The pool's root: `machines/` (machines' images), `stock/` (spare images), `snapshots/`. */
  readonly dir: string;
  /** How copies are made here: `reflink` (constant time) or `copy` (the bytes a disk holds). */
  readonly copies: "reflink" | "copy";
  /** What backs the pool, for GET /v1/ready and the logs. */
  describe(): string;
  /** Makes `dest` a copy of `src`: shared blocks where the pool reflinks, else a sparse copy. */
  clone(src: string, dest: string): Promise<void>;
  /**
   * clone() of the image of the filesystem mounted at `mountPoint`, with that filesystem frozen around the copy
   * (`fsfreeze` flushes it into the image; writes wait meanwhile). One process for freeze, copy and thaw: it thaws
   * even when the server dies meanwhile.
   */
  cloneFrozen(mountPoint: string, src: string, dest: string): Promise<void>;
  /** Unmounts an XFS pool nothing uses any more (no machine disk attached from it); one in use stays mounted. */
  close(): Promise<void>;
}

async function canReflink(dir: string): Promise<boolean> {
  const a = join(dir, `.reflink-probe-${process.pid}`);
  const b = `${a}.copy`;
  try {
    await writeFile(a, "kiln");
    await exec("cp", ["--reflink=always", a, b]);
    return true;
  } catch {
    return false;
  } finally {
    await Promise.all([rm(a, { force: true }), rm(b, { force: true })]);
  }
}

async function hasMkfsXfs(): Promise<boolean> {
  for (const dir of ["/usr/sbin", "/sbin", "/usr/bin"]) if (existsSync(join(dir, "mkfs.xfs"))) return true;
  return false;
}

function loopBacking(name: string): string | undefined {
  try {
    return readFileSync(`/sys/block/${name}/loop/backing_file`, "utf8").trim().replace(/ \(deleted\)$/, "");
  } catch {
    return undefined;
  }
}

/** True while some mount's device is a loop device backed by a file in the pool (a machine's disk). */
function mountedFromPool(dir: string): boolean {
  for (const line of readFileSync("/proc/self/mountinfo", "utf8").split("\n")) {
    const source = line.split(" - ")[1]?.split(" ")[1] ?? "";
    const loop = /^\/dev\/(loop\d+)$/.exec(source)?.[1];
    if (loop && loopBacking(loop)?.startsWith(dir + "/")) return true;
  }
  return false;
}

function failure(err: unknown): string {
  return ((err as { stderr?: string }).stderr || (err as Error).message).trim();
}

/**
 * Opens the pool of the data dir: the XFS file a server before this one mounted (still mounted after a kill -9, or
 * mounted again now), or a new one when the data dir cannot reflink. `off` keeps plain copies in the data dir.
 */
export async function openDiskPool(opts: {
  dataDir: string;
  mode: DiskPoolMode;
  log: Logger;
  /** The mount helper, when there is one: a frozen reflink is then one process of it instead of four (sh, fsfreeze, cp, fsfreeze). */
  helper?: () => Promise<string | undefined>;
}): Promise<DiskPool> {
  const dir = join(opts.dataDir, "disks");
  const xfsFile = join(opts.dataDir, "disks.xfs");
  await mkdir(dir, { recursive: true });
  let kind: "xfs-loop" | "data-dir" | "copy" = "copy";
  let why = "";

  if (isMounted(dir)) {
    kind = "xfs-loop";
    // A pool an older server mounted without discard: its freed blocks are given back from now on.
    if (existsSync(xfsFile)) await exec("mount", ["-o", "remount,discard", dir]).catch(() => undefined);
  } else if (await canReflink(dir)) kind = "data-dir";
  else if (opts.mode === "off") why = "KILN_DISK_POOL=off";
  else if (!(await hasMkfsXfs())) why = "mkfs.xfs (xfsprogs) is not installed";
  else if ((await readdir(dir)).length > 0 && !existsSync(xfsFile)) why = `${dir} already holds plain copies`;
  else {
    try {
      if (!existsSync(xfsFile)) {
        const fs = await statfs(opts.dataDir);
        const size = Math.max(MIN_POOL_BYTES, Number(fs.blocks) * Number(fs.bsize));
        await writeFile(xfsFile, "");
        await truncate(xfsFile, size);
        await exec("mkfs.xfs", ["-q", "-m", "reflink=1", xfsFile]).catch(async (err: unknown) => {
          await rm(xfsFile, { force: true });
          throw err;
        });
      }
      // discard: blocks XFS frees (a deleted snapshot, a destroyed machine's image) become holes of the sparse file
      // again, so the data dir's free space, which disk admission reads, has them back.
      await exec("mount", ["-t", "xfs", "-o", "loop,noatime,discard", xfsFile, dir]);
      kind = "xfs-loop";
    } catch (err) {
      why = `the XFS pool could not be made: ${failure(err)}`;
    }
  }
  // The mounted pool's root comes up as mkfs made it (0755): the data dir's files are private.
  await chmod(dir, 0o700);
  if (kind === "copy") opts.log.warn({ dir, reason: why }, "machine disks cannot be reflinked: snapshots and forks copy every byte a disk holds");
  const copies = kind === "copy" ? "copy" : "reflink";

  return {
    dir,
    copies,
    describe: () =>
      kind === "xfs-loop" ? `reflink (XFS pool ${xfsFile} on ${dir})` : kind === "data-dir" ? `reflink (the data dir's filesystem)` : `copy (${why})`,
    async clone(src, dest) {
      const args = copies === "reflink" ? ["--reflink=always"] : ["--sparse=always"];
      try {
        await exec("cp", [...args, src, dest]);
      } catch (err) {
        await rm(dest, { force: true });
        throw new Error(`copying the disk image ${src} failed: ${failure(err)}`);
      }
    },
    async cloneFrozen(mountPoint, src, dest) {
      const helper = copies === "reflink" ? await opts.helper?.() : undefined;
      if (helper) {
        try {
          await exec(helper, ["freeze-clone", mountPoint, src, dest]);
          return;
        } catch (err) {
          await rm(dest, { force: true });
          throw new Error(`copying the disk image ${src} failed: ${failure(err)}`);
        }
      }
      const args = copies === "reflink" ? "--reflink=always" : "--sparse=always";
      const script = `fsfreeze --freeze "$1" || exit 1; cp ${args} -- "$2" "$3"; r=$?; fsfreeze --unfreeze "$1" || r=1; [ $r -eq 0 ] || rm -f -- "$3"; exit $r`;
      try {
        await exec("sh", ["-c", script, "sh", mountPoint, src, dest]);
      } catch (err) {
        await rm(dest, { force: true });
        throw new Error(`copying the disk image ${src} failed: ${failure(err)}`);
      }
    },
    async close() {
      if (kind !== "xfs-loop" || !isMounted(dir)) return;
      // Busy while a machine's disk is attached from it: machines outlive the control plane, and so does their pool.
      const loop = /^\/dev\/(loop\d+)$/.exec(mountSource(dir) ?? "")?.[1];
      // A machine's disk mounted from the pool keeps it: nothing to wait for. A loop device still letting go of an
      // image just unmounted (the kernel clears them asynchronously) is waited out, within a bound.
      let unmounted = false;
      for (let i = 0; i < 50 && !unmounted && !mountedFromPool(dir); i++) {
        unmounted = await exec("umount", [dir]).then(() => true, () => false);
        if (!unmounted) await new Promise((r) => setTimeout(r, 100));
      }
      if (!unmounted || !loop) return;
      // The loop device clears itself once the last mount namespace holding the pool lets go (runsc's gofers keep
      // copies of the host's mounts until they exit): wait for that, within a bound.
      for (let i = 0; i < 500 && loopBacking(loop) === xfsFile; i++) await new Promise((r) => setTimeout(r, 10));
    },
  };
}
