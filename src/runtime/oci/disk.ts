// A machine's writable layer (overlayfs upper and work dirs) on a filesystem of the machine's own size: a sparse
// ext4 image per machine, loop-mounted under the machine's dir, so a full disk is ENOSPC inside and `df /` shows it.
//
// Formatting and mounting cost ~25 ms, so a small stock of disks of the default size is made ready ahead of time, off
// the create path; a machine of another size makes its own. `mount -o loop` makes the loop device clear itself on unmount.

import { execHost } from "../host-commands.ts";
import { existsSync, readFileSync, statSync } from "node:fs";
import { chmod, chown, mkdir, readdir, rename, rm, truncate, writeFile } from "node:fs/promises";
import { basename, join } from "node:path";
import type { Logger } from "../../log.ts";
import { isMounted, mountSource } from "./mounts.ts";

// Started by the host command helper, not by the server's own thread (host-commands.ts).
const exec = execHost;
const MIB = 1024 * 1024;

export interface WritableLayer {
  /** The machine's disk: the image file and its mount point, together (moved as one from the stock). */
  dir: string;
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
export function writableLayer(machineDir: string, image?: string): WritableLayer {
  return layerAt(join(machineDir, "disk"), image);
}

/**
 * A disk's layout inside its directory; a stock disk has the same, so a rename of the directory makes it a machine's.
 * The image lies beside its mount point unless it is kept elsewhere (a disk pool that can reflink, see disk-pool.ts).
 */
export function layerAt(dir: string, image = join(dir, "disk.img")): WritableLayer {
  const mountPoint = join(dir, "mnt");
  return { dir, image, mountPoint, upper: join(mountPoint, "upper"), work: join(mountPoint, "work") };
}

/**
 * A sparse image formatted as ext4: no journal (a machine does not outlive a host crash, so there is nothing to
 * replay), no reserved blocks (the machine gets all of disk_mb), inode tables initialised lazily, no discard pass.
 */
async function format(image: string, sizeMb: number, background: boolean): Promise<void> {
  await writeFile(image, "");
  await truncate(image, sizeMb * MIB);
  const mkfs = ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", image];
  try {
    // Spares are made off the request path: at the lowest CPU priority, so they never slow a create being answered.
    if (background) await exec("nice", ["-n", "19", ...mkfs]);
    else await exec(mkfs[0], mkfs.slice(1));
  } catch (err) {
    await rm(image, { force: true });
    throw new Error(`formatting the disk image ${image} failed: ${((err as { stderr?: string }).stderr || (err as Error).message).trim()}`);
  }
}

/**
 * Mounts the layer's image (formatting it first when there is none) and makes upper and work, upper owned by `owner`.
 * noinit_itable: the kernel would otherwise zero every inode table in the background (~160 MB of writes and page
 * cache per 10 GiB image); a fresh sparse image reads as zeros already. nobarrier: the disk has no journal, so a
 * machine's data never survived a host crash in a known state; cache flushes would only send every fsync in the
 * machine (and the freeze of a snapshot: ~20 ms of its time measured) down through the image to the host's disk.
 */
export async function mountLayer(layer: WritableLayer, sizeMb: number, owner: number, background = false): Promise<void> {
  if (!isMounted(layer.mountPoint)) {
    await mkdir(layer.mountPoint, { recursive: true });
    if (!existsSync(layer.image)) await format(layer.image, sizeMb, background);
    try {
      await exec("mount", ["-t", "ext4", "-o", "loop,noatime,noinit_itable,nobarrier", layer.image, layer.mountPoint]);
    } catch (err) {
      throw new Error(`mounting the disk ${layer.image} failed: ${((err as { stderr?: string }).stderr || (err as Error).message).trim()}`);
    }
  }
  const [madeUpper] = await Promise.all([mkdir(layer.upper, { recursive: true }), mkdir(layer.work, { recursive: true })]);
  // The merged root's top directory takes its owner and mode from the upper dir: machine root's, 0755 (set by hand:
  // Kiln's umask is 077), and once made, whatever the machine sets.
  if (madeUpper !== undefined) await chmod(layer.upper, 0o755);
  await chown(layer.upper, owner, owner);
}

/**
 * Unmounts the image; the overlay on top must be unmounted first. The loop device clears itself, but the kernel does
 * that asynchronously: wait (up to 2 s) until it has, so the image's space is really freed when destroy removes it.
 */
export async function unmountWritableLayer(layer: WritableLayer): Promise<void> {
  if (!existsSync(layer.mountPoint) || !isMounted(layer.mountPoint)) return;
  const loop = /^\/dev\/(loop\d+)$/.exec(mountSource(layer.mountPoint) ?? "")?.[1];
  await exec("umount", [layer.mountPoint]).catch(() => exec("umount", ["-l", layer.mountPoint]));
  if (isMounted(layer.mountPoint)) throw new Error(`${layer.mountPoint} is still mounted`);
  if (!loop) return;
  for (let i = 0; i < 200 && attachedTo(loop, layer.image); i++) await new Promise((r) => setTimeout(r, 10));
}

/** True while loop device `name` still has `image` as its backing file. */
function attachedTo(name: string, image: string): boolean {
  try {
    return readFileSync(`/sys/block/${name}/loop/backing_file`, "utf8").trim().replace(/ \(deleted\)$/, "") === image;
  } catch {
    return false;
  }
}

/** Unmounts a ready disk that no machine took and removes it (its directory and its image). */
export async function discardLayer(layer: WritableLayer): Promise<void> {
  await unmountWritableLayer(layer).catch(() => undefined);
  await Promise.all([rm(layer.dir, { recursive: true, force: true }), rm(layer.image, { force: true })]);
}

export interface DiskStock {
  /**
   * Moves a ready (formatted, mounted) disk of `sizeMb` to `dir` (its image to `image`, when the stock keeps images
   * apart) and says so; false when none is in stock.
   */
  take(dir: string, sizeMb: number, image?: string): Promise<boolean>;
  /** How many ready disks the stock holds now. */
  spares(): number;
  /** Unmounts and removes the disks still in stock. */
  close(): Promise<void>;
}

/**
 * Keeps `count` disks of `sizeMb` ready in `dir`: formatted, mounted, upper and work made. Handing one out is a
 * rename of its directory (a mount below a renamed directory moves with it), so a create pays neither mkfs nor mount.
 * A disk is named `spare-*` only once ready; after a crash, ready ones are reused and anything else is cleared.
 */
export function createDiskStock(opts: { dir: string; sizeMb: number; count: number; owner: number; log: Logger; imagesDir?: string }): DiskStock {
  // A spare's image beside its mount point, or in the images dir under the spare's name.
  const spareLayer = (path: string) => layerAt(path, opts.imagesDir ? join(opts.imagesDir, `${basename(path)}.img`) : undefined);
  const ready: string[] = [];
  let filling: Promise<void> | undefined;
  let closed = false;
  let seq = 0;
  let scanned = false;

  async function discard(path: string) {
    await discardLayer(spareLayer(path));
  }

  async function scan() {
    scanned = true;
    await mkdir(opts.dir, { recursive: true });
    const names = await readdir(opts.dir);
    // Images kept apart whose spare is gone (a crash between the two renames of a take) are removed too.
    if (opts.imagesDir) {
      await mkdir(opts.imagesDir, { recursive: true });
      for (const image of await readdir(opts.imagesDir)) {
        if (!names.includes(image.replace(/\.img$/, ""))) await rm(join(opts.imagesDir, image), { force: true });
      }
    }
    for (const name of names) {
      const path = join(opts.dir, name);
      const layer = spareLayer(path);
      const whole = name.startsWith("spare-") && isMounted(layer.mountPoint) && existsSync(layer.upper) && existsSync(layer.image) && statSync(layer.image).size === opts.sizeMb * MIB;
      if (whole) ready.push(path);
      else await discard(path);
    }
  }

  function fill() {
    if (filling || closed || opts.count <= 0) return;
    filling = (async () => {
      if (!scanned) await scan();
      while (!closed && ready.length < opts.count) {
        const name = `${process.pid}-${Date.now()}-${seq++}`;
        const partial = join(opts.dir, `partial-${name}`);
        try {
          await mountLayer(spareLayer(partial), opts.sizeMb, opts.owner, true);
        } catch (err) {
          await discard(partial);
          throw err;
        }
        const spare = join(opts.dir, `spare-${name}`);
        if (opts.imagesDir) await rename(spareLayer(partial).image, spareLayer(spare).image);
        await rename(partial, spare);
        ready.push(spare);
      }
    })()
      .catch((err: unknown) => opts.log.warn({ err }, "preparing spare disks failed"))
      .finally(() => (filling = undefined));
  }

  return {
    async take(dir, sizeMb, image) {
      if (sizeMb !== opts.sizeMb) return false;
      if (Boolean(opts.imagesDir) !== Boolean(image)) return false;
      const spare = ready.shift();
      fill();
      if (!spare) return false;
      try {
        // A loop device follows its backing file through a rename, so the mounted image moves as it is.
        if (image) await rename(spareLayer(spare).image, image);
        await rename(spare, dir);
        return true;
      } catch (err) {
        opts.log.warn({ err }, "a spare disk could not be handed out");
        await discard(spare);
        return false;
      }
    },
    spares: () => ready.length,
    async close() {
      closed = true;
      await filling;
      // Spares a killed server left are released too, even when this one never needed a disk.
      if (!scanned) await scan().catch((err: unknown) => opts.log.warn({ err }, "looking for spare disks failed"));
      await Promise.all(ready.splice(0).map(discard));
    },
  };
}

/** Makes the machine's writable layer ready: already mounted, from the stock, or mounted (and formatted) now. */
/** An image already there (a copy of a snapshot's) is mounted as it is. */
export async function mountWritableLayer(layer: WritableLayer, sizeMb: number, owner: number, stock: DiskStock): Promise<void> {
  const apart = layer.image !== join(layer.dir, "disk.img");
  if (!existsSync(layer.dir) && !existsSync(layer.image) && (await stock.take(layer.dir, sizeMb, apart ? layer.image : undefined))) return;
  await mountLayer(layer, sizeMb, owner);
}
