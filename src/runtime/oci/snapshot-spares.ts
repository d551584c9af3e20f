// Ready copies of memory snapshots' disks: a machine restored from a memory snapshot would otherwise reflink the
// snapshot's image and loop-mount the copy on its create path — 10–30 ms, or 150–175 ms when the pool's XFS log
// force waits on the host's disk (Linux 6.18 fsyncs a loop device's backing file when it attaches one). Here that is
// done ahead: when the snapshot is taken and again after each use, off the create path. A create that finds one
// takes it with two renames (as a stock disk, disk.ts); one that does not copies as before.
//
// Bounded: at most `max` copies on the host, one per snapshot, the least recently used given up first. Each holds a
// loop device and, until a machine writes to it, no blocks of its own beyond the few its mount writes (a reflink
// shares the snapshot's); whatever it takes is the data dir's free space that disk admission reads. A copy goes when
// its snapshot is deleted and when the server closes; what a killed server left (named by its pid) goes at the next
// start (sweep), mounted or not. Names are `<snapshot id>.<pid>-<token>-<n>`. None are made where the disk pool cannot
// reflink (KILN_DISK_POOL=off): there a copy would take the snapshot's disk's size again.

import { randomBytes } from "node:crypto";
import { existsSync } from "node:fs";
import { mkdir, readdir, rename, rm } from "node:fs/promises";
import { join } from "node:path";
import type { Logger } from "../../log.ts";
import type { DiskPool } from "./disk-pool.ts";
import { discardLayer, layerAt, mountLayer } from "./disk.ts";
import type { WritableLayer } from "./disk.ts";
import { pidAlive } from "../pid-alive.ts";

export interface SnapshotSpares {
  /** Makes a ready copy of the snapshot's disk in the background, unless it has one; never throws. */
  prepare(snapshotId: string, disk: string): void;
  /** Moves the snapshot's ready copy to `layer` (its dir and its image) and says so; false when there is none. */
  take(snapshotId: string, layer: WritableLayer): Promise<boolean>;
  /** Removes the snapshot's copy (waiting for one being made). */
  drop(snapshotId: string): Promise<void>;
  /** How many ready copies the host holds. */
  count(): number;
  /** Removes what a killed server left: every copy not made by a live process of this one. */
  sweep(): Promise<void>;
  /** Removes every copy (the server is closing). */
  close(): Promise<void>;
}

export function createSnapshotSpares(opts: { dir: string; pool: () => Promise<DiskPool>; owner: number; max: number; log: Logger }): SnapshotSpares {
  /** Ready copies by snapshot id, least recently used first (a Map keeps insertion order). */
  const ready = new Map<string, string>();
  /** Copies being made, by snapshot id. */
  const making = new Map<string, Promise<void>>();
  let seq = 0;
  // With the pid in each copy's name: a later server given the same pid (a container's) still tells its own apart.
  const token = randomBytes(4).toString("hex");
  let closed = false;
  let swept: Promise<void> | undefined;
  let imagesSwept: Promise<void> | undefined;

  const imagesDir = async () => join((await opts.pool()).dir, "spares");
  const layerOf = async (name: string) => layerAt(join(opts.dir, name), join(await imagesDir(), `${name}.img`));

  async function discard(name: string) {
    await discardLayer(await layerOf(name));
  }

  async function make(snapshotId: string, disk: string): Promise<void> {
    await (swept ??= sweepNow());
    const pool = await opts.pool();
    await (imagesSwept ??= sweepImages());
    // Without reflinks a copy would hold every byte of the snapshot's disk a second time, read and written in full.
    if (pool.copies !== "reflink") return;
    // The least recently used copies make room: those ready and those being made (this one too) stay within the bound.
    while (ready.size > 0 && ready.size + making.size > opts.max) {
      const [oldest, name] = ready.entries().next().value!;
      ready.delete(oldest);
      await discard(name);
    }
    const name = `${snapshotId}.${process.pid}-${token}-${seq++}`;
    const layer = await layerOf(name);
    await Promise.all([mkdir(layer.dir, { recursive: true }), mkdir(await imagesDir(), { recursive: true })]);
    try {
      await pool.clone(disk, layer.image);
      await mountLayer(layer, 0, opts.owner, true);
    } catch (err) {
      await discardLayer(layer);
      throw err;
    }
    // Deleted or closed meanwhile: not kept.
    if (closed || !existsSync(disk)) return discardLayer(layer);
    ready.set(snapshotId, name);
  }

  /** A copy this server process made (or is making), or one of another live server process on the same data dir. */
  const ours = (name: string) => name.includes(`.${process.pid}-${token}-`);
  const others = (name: string) => {
    const pid = Number(/\.(\d+)-[0-9a-f]+-\d+$/.exec(name)?.[1]);
    return pid > 0 && pid !== process.pid && pidAlive(pid);
  };

  async function sweepNow(): Promise<void> {
    // Left-overs of another (killed) server process on this data dir, mounted or half made. A copy's directory is
    // made before its image, so every image has one.
    const names = await readdir(opts.dir).catch(() => [] as string[]);
    await Promise.all(names.filter((n) => !ours(n) && !others(n)).map(discard));
  }

  /**
   * Images whose directory went first: a server killed between the two removals of discardLayer (they run side by
   * side) left them, named by no directory. Removed once the disk pool is open anyway (the first copy, the close):
   * the start's sweep does not open the pool for them.
   */
  async function sweepImages(): Promise<void> {
    const images = await imagesDir();
    const strays = (await readdir(images).catch(() => [] as string[])).filter((f) => f.endsWith(".img") && !ours(f.slice(0, -4)) && !others(f.slice(0, -4)));
    await Promise.all(strays.map((f) => rm(join(images, f), { force: true })));
  }

  return {
    prepare(snapshotId, disk) {
      if (closed || making.size >= opts.max || ready.has(snapshotId) || making.has(snapshotId) || !existsSync(disk)) return;
      const job = make(snapshotId, disk)
        // A snapshot deleted meanwhile (a fork's, once its children are made) leaves nothing to say.
        .catch((err: unknown) => {
          if (existsSync(disk)) opts.log.warn({ err, snapshot_id: snapshotId }, "preparing a snapshot's disk ahead failed");
        })
        .finally(() => making.delete(snapshotId));
      making.set(snapshotId, job);
    },

    async take(snapshotId, layer) {
      const name = ready.get(snapshotId);
      if (!name) return false;
      ready.delete(snapshotId);
      const spare = await layerOf(name);
      try {
        // A loop device follows its backing file through a rename, so the mounted image moves as it is.
        await rename(spare.image, layer.image);
        await rename(spare.dir, layer.dir);
        return true;
      } catch (err) {
        opts.log.warn({ err, snapshot_id: snapshotId }, "a snapshot's ready disk could not be handed out");
        // Half moved: the image may already be the machine's; it is removed with the rest, and the caller copies anew.
        await discardLayer({ ...spare, image: existsSync(spare.image) ? spare.image : layer.image });
        return false;
      }
    },

    async drop(snapshotId) {
      await making.get(snapshotId);
      const name = ready.get(snapshotId);
      if (!name) return;
      ready.delete(snapshotId);
      await discard(name);
    },

    count: () => ready.size,

    sweep: () => (swept ??= sweepNow()),

    async close() {
      closed = true;
      await Promise.all(making.values());
      const names = [...ready.values()];
      ready.clear();
      await Promise.all(names.map(discard));
      // A killed server's copies go too, even when this one never made one.
      await sweepNow();
      await sweepImages();
    },
  };
}
