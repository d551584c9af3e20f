// Consistent copies of a running machine's disk: its processes frozen, its filesystem frozen (fsfreeze flushes it
// into the image), the image reflinked, everything thawed. A marker file says a freeze is under way, so a server
// killed in the middle leaves nothing frozen: the next one thaws what the marker names (thawInterrupted). The marker
// names the process taking the snapshot, so a look at live machines meanwhile never thaws one being copied.

import { execHost } from "../host-commands.ts";
import { existsSync } from "node:fs";
import { randomBytes } from "node:crypto";
import { mkdir, readdir, readFile, rm, stat, writeFile } from "node:fs/promises";
import { join } from "node:path";
import type { DiskPool } from "./disk-pool.ts";
import { isMounted, mountSource } from "./mounts.ts";

// Started by the host command helper, not by the server's own thread (host-commands.ts).
const exec = execHost;
const FREEZE_MARKER = "snapshot-freeze";

export interface FreezeHooks {
  /** Whether the machine's processes are frozen already (a hibernated machine): then they are left so. */
  paused(): Promise<boolean>;
  /** Freezes the machine's processes (the runtime's pause). */
  pause(): Promise<void>;
  resume(): Promise<void>;
}

function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}

/** The bytes a file takes on disk (a sparse image's allocated blocks, not its size). */
export async function allocatedBytes(path: string): Promise<number> {
  const st = await stat(path);
  return st.blocks * 512;
}

/**
 * Copies the disk image of a live machine (its writable layer mounted at `mountPoint`) to `dest`, consistent as of
 * one instant: no process runs and no write is in flight while the copy is taken.
 */
export async function copyLiveDisk(opts: { machineDir: string; mountPoint: string; image: string; dest: string; pool: DiskPool; hooks: FreezeHooks }): Promise<Record<string, number>> {
  const marker = join(opts.machineDir, FREEZE_MARKER);
  const ms: Record<string, number> = {};
  let t = performance.now();
  const lap = (name: string) => {
    const now = performance.now();
    ms[name] = Math.round((now - t) * 10) / 10;
    t = now;
  };
  // The marker says whether the processes are to be thawed too, before they are frozen.
  const pausing = !(await opts.hooks.paused());
  await writeFile(marker, JSON.stringify({ pid: process.pid, resume: pausing }));
  lap("state_ms");
  try {
    if (pausing) await opts.hooks.pause();
    lap("pause_ms");
    await opts.pool.cloneFrozen(opts.mountPoint, opts.image, opts.dest);
    lap("copy_ms");
  } finally {
    if (pausing) await opts.hooks.resume();
    await rm(marker, { force: true });
    lap("resume_ms");
  }
  return ms;
}

/**
 * After a server died during copyLiveDisk: thaws the machine's filesystem and processes so it is not left frozen
 * (and not mistaken for a hibernated one). True when there was something to thaw.
 */
export async function thawInterrupted(machineDir: string, mountPoint: string, resume: () => Promise<void>): Promise<boolean> {
  const marker = join(machineDir, FREEZE_MARKER);
  if (!existsSync(marker)) return false;
  let left: { pid?: number; resume?: boolean } = {};
  try {
    left = JSON.parse(await readFile(marker, "utf8"));
  } catch {
    // unreadable: thawed as if its writer were gone
  }
  if (left.pid && processAlive(left.pid)) return false; // a snapshot under way, not one cut short
  await exec("fsfreeze", ["--unfreeze", mountPoint]).catch(() => undefined); // EINVAL when it was not frozen
  if (left.resume) await resume().catch(() => undefined);
  await rm(marker, { force: true });
  return true;
}

/** Where snapshot images are mounted read-only while their files are copied out (`<pid>-<random>` each). */
function readsDir(dataDir: string): string {
  return join(dataDir, "snapshot-reads");
}

/**
 * Copies the writable layer (overlayfs upper dir) held in a snapshot's disk image to `dest`, as it is: ownership in
 * the machines' canonical range, whiteout devices and opaque-dir xattrs kept, so `dest` is a template layer. The
 * image is mounted read-only (it is never changed) on a mount point of its own, unmounted before this returns.
 */
export async function copySnapshotLayer(opts: { dataDir: string; image: string; dest: string }): Promise<void> {
  await sweepSnapshotReads(opts.dataDir);
  const mnt = join(readsDir(opts.dataDir), `${process.pid}-${randomBytes(4).toString("hex")}`);
  await mkdir(mnt, { recursive: true });
  let mounted = false;
  try {
    await exec("mount", ["-t", "ext4", "-o", "loop,ro,noatime", opts.image, mnt]);
    mounted = true;
    const upper = join(mnt, "upper");
    await mkdir(opts.dest, { recursive: true });
    // An image that never held a machine's files (a machine that wrote nothing before its disk was made) has none.
    if (existsSync(upper)) await exec("cp", ["-a", "--preserve=all", `${upper}/.`, opts.dest], { maxBuffer: 1024 * 1024 });
  } catch (err) {
    await rm(opts.dest, { recursive: true, force: true });
    throw new Error(`copying the files of ${opts.image} failed: ${((err as { stderr?: string }).stderr || (err as Error).message).trim()}`);
  } finally {
    if (mounted) await unmountRead(mnt, opts.image);
    await rm(mnt, { recursive: true, force: true });
  }
}

/** Unmounts a read and waits (within a bound) until its loop device let go of the image, so nothing is left attached. */
async function unmountRead(mnt: string, image?: string): Promise<void> {
  const loop = /^\/dev\/(loop\d+)$/.exec(mountSource(mnt) ?? "")?.[1];
  await exec("umount", [mnt]).catch(() => exec("umount", ["-l", mnt]));
  if (!loop || !image) return;
  for (let i = 0; i < 200; i++) {
    const backing = await readFile(`/sys/block/${loop}/loop/backing_file`, "utf8").catch(() => "");
    if (backing.trim().replace(/ \(deleted\)$/, "") !== image) return;
    await new Promise((r) => setTimeout(r, 10));
  }
}

/** Reads a server killed mid-copy left mounted (their process is gone): unmounted and removed. */
export async function sweepSnapshotReads(dataDir: string): Promise<void> {
  const dir = readsDir(dataDir);
  for (const name of await readdir(dir).catch(() => [] as string[])) {
    const pid = Number(/^(\d+)-/.exec(name)?.[1]);
    if (pid && processAlive(pid)) continue; // a read under way (this server's, or another's on the same data dir)
    const mnt = join(dir, name);
    if (isMounted(mnt)) await unmountRead(mnt);
    await rm(mnt, { recursive: true, force: true }).catch(() => undefined);
  }
}
