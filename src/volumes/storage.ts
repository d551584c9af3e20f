// A volume's bytes on the host: a sparse image file holding an ext4 filesystem, loop-mounted under
// $KILN_DATA_DIR/volumes/<id>/mnt. The filesystem's own size is the volume's size limit (ENOSPC past it).

import { execFile } from "node:child_process";
import { chmod, chown, mkdir, open, rm, rmdir, statfs } from "node:fs/promises";
import { existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { promisify } from "node:util";
import { isMounted } from "../runtime/oci/mounts.ts";
import { HOST_ID_BASE } from "../runtime/oci/idmap.ts";
import { KilnError } from "../errors.ts";

const exec = promisify(execFile);

/** The machines' `user` (uid/gid 1000 inside every machine) as the host sees it: the volume root's owner. */
export const VOLUME_OWNER = { uid: HOST_ID_BASE + 1000, gid: HOST_ID_BASE + 1000 };
/** Volume ids become path components: nothing but these characters. */
const SAFE_ID = /^vol_[a-z0-9]{26}$/;
/** nosuid/nodev: nothing a machine writes into a volume becomes a setuid binary or a device on the host. */
const MOUNT_OPTIONS = "loop,nosuid,nodev,noatime";

export interface VolumePaths {
  dir: string;
  image: string;
  mount: string;
  /** Empty directory the watcher's private root is mounted on, inside the watcher's own mount namespace. */
  watchRoot: string;
}

export function volumePaths(dataDir: string, id: string): VolumePaths {
  if (!SAFE_ID.test(id)) throw new Error(`invalid volume id ${JSON.stringify(id)}`);
  const dir = join(dataDir, "volumes", id);
  return { dir, image: join(dir, "image.ext4"), mount: join(dir, "mnt"), watchRoot: join(dir, "watch-root") };
}

/** Free bytes on the filesystem that holds the data dir (volumes are sparse: this is what they can still grow into). */
export async function hostFreeBytes(dataDir: string): Promise<number> {
  await mkdir(join(dataDir, "volumes"), { recursive: true });
  const s = await statfs(join(dataDir, "volumes"));
  return s.bavail * s.bsize;
}

/**
 * Makes the image (sparse: it costs only what is written), an ext4 filesystem on it whose root belongs to the
 * machines' user, and mounts it. No reserved blocks, so the whole size is usable from inside a machine.
 */
export async function createVolumeStorage(paths: VolumePaths, sizeMb: number): Promise<void> {
  await makeMountPoint(paths);
  const fh = await open(paths.image, "wx", 0o600);
  try {
    await fh.truncate(sizeMb * 1024 * 1024);
  } finally {
    await fh.close();
  }
  await exec("mkfs.ext4", ["-F", "-q", "-m", "0", "-E", `root_owner=${VOLUME_OWNER.uid}:${VOLUME_OWNER.gid},lazy_itable_init=1,lazy_journal_init=1`, paths.image]);
  await mountVolumeStorage(paths);
  // mkfs leaves lost+found; a fresh volume is empty to its users (e2fsck makes it again when it needs it).
  await rmdir(join(paths.mount, "lost+found")).catch(() => undefined);
}

/**
 * Mounts the image unless it is mounted already (the normal case after a server restart). When the image is still
 * attached to a loop device — machines hold the filesystem although the host mount is gone — that device is
 * mounted again, never a second loop device over the same image (two ext4 mounts of one image corrupt it).
 */
export async function mountVolumeStorage(paths: VolumePaths): Promise<void> {
  if (isMounted(paths.mount)) return;
  await makeMountPoint(paths);
  const attached = await loopDevicesOf(paths.image);
  if (attached.length > 0) await exec("mount", ["-o", "nosuid,nodev,noatime", attached[0], paths.mount]);
  else await exec("mount", ["-o", MOUNT_OPTIONS, paths.image, paths.mount]);
}

/**
 * The mount point and its parents: searchable but not listable (0711), as the machines' root dirs are — gVisor's
 * gofer opens a bind source as an unprivileged id and must pass through them — except the volume's own dir, which
 * only root and the machines' group may enter (its mount is a filesystem of the machines' files); the image stays 0600.
 */
async function makeMountPoint(paths: VolumePaths) {
  for (const dir of [dirname(paths.dir), paths.dir, paths.mount]) {
    await mkdir(dir, { recursive: true });
    if (dir === paths.dir) await chown(dir, 0, HOST_ID_BASE);
    await chmod(dir, dir === paths.dir ? 0o710 : 0o711);
  }
}

/** Loop devices backed by `image` (`losetup -j`). */
export async function loopDevicesOf(image: string): Promise<string[]> {
  if (!existsSync(image)) return [];
  const { stdout } = await exec("losetup", ["-j", image]).catch(() => ({ stdout: "" }));
  return stdout
    .split("\n")
    .map((l) => l.split(":")[0])
    .filter((d) => d.startsWith("/dev/loop"));
}

/**
 * Unmounts and removes everything of the volume. `mount -o loop` set autoclear, so the loop device goes with the
 * last mount; a device left attached (a lazy unmount still draining) is detached explicitly.
 */
export async function destroyVolumeStorage(paths: VolumePaths): Promise<void> {
  if (isMounted(paths.mount)) {
    await exec("umount", [paths.mount]).catch(async () => {
      // Something still has a file open in it (an upload in flight): detach now, the kernel finishes when it closes.
      await exec("umount", ["-l", paths.mount]);
    });
  }
  // Never remove the directory through a live mount: that would delete the volume's files, not the mount.
  if (isMounted(paths.mount)) throw new Error(`${paths.mount} is still mounted`);
  for (const dev of await loopDevicesOf(paths.image)) await exec("losetup", ["-d", dev]).catch(() => undefined);
  await rm(paths.dir, { recursive: true, force: true });
}

/** Releases the host mount (and its loop device) but keeps the image: refused while something holds it open. */
export async function unmountVolumeStorage(paths: VolumePaths): Promise<void> {
  if (isMounted(paths.mount)) {
    await exec("umount", [paths.mount]).catch((err: Error) => {
      throw new KilnError("conflict", `The volume is in use on its host (${err.message.split("\n")[0]?.slice(0, 200)}); try again`);
    });
  }
  for (const dev of await loopDevicesOf(paths.image)) await exec("losetup", ["-d", dev]).catch(() => undefined);
}

/** Bytes used and total as the volume's own filesystem counts them. */
export async function volumeUsage(paths: VolumePaths): Promise<{ usedBytes: number; totalBytes: number }> {
  const s = await statfs(paths.mount);
  return { usedBytes: (s.blocks - s.bfree) * s.bsize, totalBytes: s.blocks * s.bsize };
}
