// A machine's writable layer (overlayfs upper and work dirs) on a filesystem of the machine's own size: a sparse
// ext4 image per machine, loop-mounted under the machine's dir, so a full disk is ENOSPC inside and `df /` shows it.
//
// Formatting costs ~15 ms, so a small stock of images of the default size is formatted ahead of time, off the create
// path; a machine of another size formats its own. `mount -o loop` sets the loop device to clear itself on unmount.

import { execFile } from "node:child_process";
import { existsSync, statSync } from "node:fs";
import { mkdir, readdir, rename, rm, truncate, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { promisify } from "node:util";
import type { Logger } from "../../log.ts";
import { isMounted } from "./mounts.ts";

const exec = promisify(execFile);
const MIB = 1024 * 1024;

export interface WritableLayer {
  /** The sparse image file holding the machine's filesystem. */
  image: string;
  /** Where the image is mounted; upper and work live on it (overlayfs needs both on one filesystem). */
  mountPoint: string;
  upper: string;
  work: string;
}

/**
 * The one place that says where a machine's writable layer lives. Whoever takes a stopped machine's upper dir out
 * (a template build capturing a layer) reads `upper` from here while the image is still mounted.
 */
export function writableLayer(machineDir: string): WritableLayer {
  const mountPoint = join(machineDir, "disk");
  return { image: join(machineDir, "disk.img"), mountPoint, upper: join(mountPoint, "upper"), work: join(mountPoint, "work") };
}

/**
 * A sparse image formatted as ext4: no journal (a machine does not outlive a host crash, so there is nothing to
 * replay), no reserved blocks (the machine gets all of disk_mb), inode tables initialised lazily, no discard pass.
 */
async function format(image: string, sizeMb: number): Promise<void> {
  await writeFile(image, "");
  await truncate(image, sizeMb * MIB);
  try {
    await exec("mkfs.ext4", ["-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", image]);
  } catch (err) {
    await rm(image, { force: true });
    throw new Error(`formatting the disk image ${image} failed: ${((err as { stderr?: string }).stderr || (err as Error).message).trim()}`);
  }
}

export interface DiskStock {
  /** Puts a formatted image of `sizeMb` at `image`: from the stock when it holds that size, else formatted now. */
  make(image: string, sizeMb: number): Promise<void>;
  close(): Promise<void>;
}

/** Keeps `count` formatted images of `sizeMb` in `dir` (left ones are reused after a restart). */
export function createDiskStock(opts: { dir: string; sizeMb: number; count: number; log: Logger }): DiskStock {
  const ready: string[] = [];
  let filling: Promise<void> | undefined;
  let closed = false;
  let seq = 0;
  let scanned = false;

  async function scan() {
    scanned = true;
    await mkdir(opts.dir, { recursive: true });
    for (const name of await readdir(opts.dir)) {
      const path = join(opts.dir, name);
      // A half-formatted image (the server died during mkfs) is not trusted: only a finished one is renamed to .img.
      if (name.endsWith(".img") && statSync(path).size === opts.sizeMb * MIB) ready.push(path);
      else await rm(path, { force: true });
    }
  }

  function fill() {
    if (filling || closed || opts.count <= 0) return;
    filling = (async () => {
      if (!scanned) await scan();
      while (!closed && ready.length < opts.count) {
        const base = join(opts.dir, `${process.pid}-${Date.now()}-${seq++}`);
        await format(`${base}.part`, opts.sizeMb);
        await rename(`${base}.part`, `${base}.img`);
        ready.push(`${base}.img`);
      }
    })()
      .catch((err: unknown) => opts.log.warn({ err }, "formatting spare disk images failed"))
      .finally(() => (filling = undefined));
  }

  return {
    async make(image, sizeMb) {
      const spare = sizeMb === opts.sizeMb ? ready.shift() : undefined;
      if (spare) {
        try {
          await rename(spare, image);
          return;
        } catch {
          // gone from under us: format one instead
        } finally {
          fill();
        }
      }
      await format(image, sizeMb);
      fill();
    },
    async close() {
      closed = true;
      await filling;
    },
  };
}

/** Formats (or takes from the stock) the machine's image and mounts it, with its upper and work dirs made. */
export async function mountWritableLayer(layer: WritableLayer, sizeMb: number, stock: DiskStock): Promise<void> {
  if (!isMounted(layer.mountPoint)) {
    if (!existsSync(layer.image)) await stock.make(layer.image, sizeMb);
    await mkdir(layer.mountPoint, { recursive: true });
    try {
      await exec("mount", ["-t", "ext4", "-o", "loop,noatime", layer.image, layer.mountPoint]);
    } catch (err) {
      throw new Error(`mounting the disk of ${layer.mountPoint} failed: ${((err as { stderr?: string }).stderr || (err as Error).message).trim()}`);
    }
  }
  await Promise.all([mkdir(layer.upper, { recursive: true }), mkdir(layer.work, { recursive: true })]);
}

/** Unmounts the image (its loop device clears itself). The overlay on top must be unmounted first. */
export async function unmountWritableLayer(layer: WritableLayer): Promise<void> {
  if (!existsSync(layer.mountPoint) || !isMounted(layer.mountPoint)) return;
  await exec("umount", [layer.mountPoint]).catch(() => exec("umount", ["-l", layer.mountPoint]));
  if (isMounted(layer.mountPoint)) throw new Error(`${layer.mountPoint} is still mounted`);
}
