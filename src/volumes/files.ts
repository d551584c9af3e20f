// File operations on a mounted volume, done by the host on a directory that machine root can write. Every path is
// walked from an fd of the volume root one component at a time, never following a symlink (see docs/volumes.md).

import { constants as fsc } from "node:fs";
import type { Stats } from "node:fs";
import { lstat, mkdir, open, readdir, readlink, rename, rmdir, unlink } from "node:fs/promises";
import type { FileHandle } from "node:fs/promises";
import { posix } from "node:path";
import { pipeline } from "node:stream/promises";
import { Readable } from "node:stream";
import { randomBytes } from "node:crypto";
import { KilnError } from "../errors.ts";
import { HOST_ID_BASE, ID_RANGE } from "../runtime/oci/idmap.ts";
import { VOLUME_OWNER } from "./storage.ts";
import type { FileInfo } from "../agent/protocol.ts";
import { statToFileInfo } from "../agent/file-info.ts";
import type { OwnerNames } from "../agent/file-info.ts";
import { LIST_DEFAULT_LIMIT, dirNames, listPage } from "../agent/list-pages.ts";
import type { TreeSource } from "../agent/list-pages.ts";

const DIR_FLAGS = fsc.O_RDONLY | fsc.O_DIRECTORY | fsc.O_NOFOLLOW;
/** O_NONBLOCK: a FIFO a machine made must not hang the API's open. */
const READ_FLAGS = fsc.O_RDONLY | fsc.O_NOFOLLOW | fsc.O_NONBLOCK;
const CREATE_FLAGS = fsc.O_WRONLY | fsc.O_CREAT | fsc.O_EXCL | fsc.O_NOFOLLOW;
/** Directories a recursive remove holds open at once, however deep the tree (removeTree). */
const REMOVE_OPEN_DIRS = 32;
/** Uploads in flight; the watcher hides them, so a watch sees the finished file appear once. */
export const UPLOAD_PREFIX = ".kiln-upload-";
/** The letter after the prefix of an upload that replaces an existing file. */
export const UPLOAD_REPLACES = "w";

/**
 * `/proc/self/fd/<dir>/<name>`: the kernel jumps to the open directory itself (not to a path that could have been
 * swapped since) and looks up one name in it; with O_NOFOLLOW / lstat / rename / unlink that name is never followed.
 * This is openat(2) for a runtime that only offers path-based calls.
 */
function at(dir: FileHandle, name: string): string {
  return `/proc/self/fd/${dir.fd}/${name}`;
}

/** A volume path as its components: absolute, NUL-free, normalised (so `..` stops at the volume root). */
export function volumePathComponents(path: string): string[] {
  if (typeof path !== "string" || !path.startsWith("/")) throw new KilnError("invalid_request", `Volume paths are absolute, rooted at the volume's /: ${JSON.stringify(path)}`);
  if (path.includes("\0")) throw new KilnError("invalid_request", "path contains a NUL byte");
  return posix
    .normalize(path)
    .split("/")
    .filter((c) => c !== "" && c !== ".");
}

export function volumePathOf(components: string[]): string {
  return "/" + components.join("/");
}

/** Machine-side names for host ids: the machines' `user` and `root` by name, other mapped ids as numbers. */
function ownerName(hostId: number): string {
  const id = hostId - HOST_ID_BASE;
  if (id < 0 || id >= ID_RANGE) return "nobody";
  if (id === 0) return "root";
  if (id === 1000) return "user";
  return String(id);
}

function failure(err: unknown, path: string): KilnError {
  if (err instanceof KilnError) return err;
  const code = (err as NodeJS.ErrnoException)?.code;
  switch (code) {
    case "ENOENT":
      return new KilnError("not_found", `No such file or directory: ${path}`);
    case "ELOOP":
      return new KilnError("invalid_request", `${path} passes through a symlink; volume paths never follow symlinks`);
    case "ENOTDIR":
      return new KilnError("invalid_request", `A parent of ${path} is not a directory`);
    case "EISDIR":
      return new KilnError("invalid_request", `${path} is a directory`);
    case "EEXIST":
      return new KilnError("conflict", `${path} already exists`);
    case "ENOTEMPTY":
      return new KilnError("invalid_request", `${path} is a non-empty directory (use recursive)`);
    case "EINVAL":
      return new KilnError("invalid_request", `Cannot move a directory into itself: ${path}`);
    case "ENOSPC":
    case "EDQUOT":
      return new KilnError("payload_too_large", `The volume is full: ${path}`, { detail: { details: { reason: "volume_full" } } });
    case "ENXIO": // a socket opened as a file
    case "ENODEV":
      return new KilnError("invalid_request", `${path} is not a regular file`);
    case "ENAMETOOLONG":
      return new KilnError("invalid_request", `A name in ${path} is too long`);
    case "EACCES":
    case "EPERM":
    case "EROFS":
      return new KilnError("forbidden", `Permission denied: ${path}`);
    default:
      return new KilnError("internal", `${code ?? "error"} on ${path}`, { cause: err });
  }
}

const volumeOwners: OwnerNames = { user: ownerName, group: ownerName };

function describe(path: string, st: Stats, target?: string): FileInfo {
  return statToFileInfo(path, st, volumeOwners, target);
}

/** The file operations of one mounted volume. `mountPath` is Kiln's own mount point, trusted. */
export function volumeFiles(mountPath: string) {
  async function openRoot(): Promise<FileHandle> {
    return open(mountPath, fsc.O_RDONLY | fsc.O_DIRECTORY);
  }

  /**
   * The directory at `dirs` below `root`, each component opened relative to the one before with O_NOFOLLOW, so a
   * symlink anywhere (even one swapped in a moment ago) fails the walk instead of leading out of the volume.
   * With `create`, missing directories are made (mkdir -p) and given to the machines' user.
   */
  async function walk(root: FileHandle, dirs: string[], create?: { mode: number }): Promise<FileHandle> {
    let dir = root;
    try {
      for (let i = 0; i < dirs.length; i++) {
        let next: FileHandle;
        try {
          next = await open(at(dir, dirs[i]), DIR_FLAGS);
        } catch (err) {
          if ((err as NodeJS.ErrnoException).code !== "ENOENT" || !create) throw err;
          await mkdir(at(dir, dirs[i]), { mode: create.mode }).catch((e: NodeJS.ErrnoException) => (e.code === "EEXIST" ? undefined : Promise.reject(e)));
          next = await open(at(dir, dirs[i]), DIR_FLAGS);
          // Through the fd: whatever now sits at that name, only the directory we made and opened changes owner.
          const st = await next.stat();
          if (st.uid !== VOLUME_OWNER.uid) await next.chown(VOLUME_OWNER.uid, VOLUME_OWNER.gid);
          await next.chmod(create.mode);
        }
        if (dir !== root) await dir.close();
        dir = next;
      }
      return dir;
    } catch (err) {
      if (dir !== root) await dir.close();
      throw err;
    }
  }

  /** Runs `fn` with the parent directory of a non-root path open, closing everything after. */
  async function withParent<T>(path: string, fn: (parent: FileHandle, name: string, shown: string) => Promise<T>, create?: { mode: number }): Promise<T> {
    const comps = volumePathComponents(path);
    const shown = volumePathOf(comps);
    if (comps.length === 0) throw new KilnError("invalid_request", "This operation needs a path below the volume root /");
    const root = await openRoot();
    try {
      const parent = await walk(root, comps.slice(0, -1), create).catch((err: unknown) => Promise.reject(failure(err, shown)));
      try {
        return await fn(parent, comps.at(-1)!, shown);
      } catch (err) {
        throw failure(err, shown);
      } finally {
        if (parent !== root) await parent.close();
      }
    } finally {
      await root.close();
    }
  }

  async function infoAt(parent: FileHandle, name: string, shown: string): Promise<FileInfo> {
    const st = await lstat(at(parent, name));
    return describe(shown, st, st.isSymbolicLink() ? await readlink(at(parent, name)) : undefined);
  }

  /** Opens the directory at `path` itself (the root included). */
  async function withDir<T>(path: string, fn: (dir: FileHandle, shown: string) => Promise<T>, create?: { mode: number }): Promise<T> {
    const comps = volumePathComponents(path);
    const shown = volumePathOf(comps);
    const root = await openRoot();
    try {
      const dir = await walk(root, comps, create).catch((err: unknown) => Promise.reject(failure(err, shown)));
      try {
        return await fn(dir, shown);
      } catch (err) {
        throw failure(err, shown);
      } finally {
        if (dir !== root) await dir.close();
      }
    } finally {
      await root.close();
    }
  }

  async function info(path: string): Promise<FileInfo> {
    if (volumePathComponents(path).length === 0) return withDir("/", async (dir) => describe("/", await dir.stat()));
    return withParent(path, infoAt);
  }

  /**
   * One page of the listing of `path`, `depth` deep (list-pages.ts): each directory is walked from its fd like every
   * other operation here, its names streamed, never read whole.
   */
  async function list(path: string, depth: number, page: { limit?: number; after?: string[] } = {}): Promise<{ entries: FileInfo[]; next?: string[] }> {
    return withDir(path, (root, rootShown) => {
      const tree: TreeSource<FileHandle, FileInfo> = {
        names: (dir) => dirNames(`/proc/self/fd/${dir.fd}`),
        async entry(dir, name, names) {
          const st = await lstat(at(dir, name)).catch(() => undefined);
          if (!st) return undefined; // removed while we listed
          const shown = posix.join(rootShown, ...names);
          return { entry: describe(shown, st, st.isSymbolicLink() ? await readlink(at(dir, name)).catch(() => "") : undefined), isDir: st.isDirectory() };
        },
        // Swapped or removed meanwhile: skipped.
        open: (dir, name) => open(at(dir, name), DIR_FLAGS).catch(() => undefined),
        close: (dir) => dir.close(),
      };
      return listPage(tree, root, { depth, limit: page.limit ?? LIST_DEFAULT_LIMIT, after: page.after });
    });
  }

  /** A regular file's bytes; symlinks, directories, FIFOs and devices are refused, never opened through. */
  async function read(path: string): Promise<Readable> {
    return withParent(path, async (parent, name, shown) => {
      const fh = await open(at(parent, name), READ_FLAGS);
      const st = await fh.stat().catch(async (err: unknown) => {
        await fh.close();
        throw err;
      });
      if (!st.isFile()) {
        await fh.close();
        throw new KilnError("invalid_request", `${shown} is not a regular file`);
      }
      return fh.createReadStream();
    });
  }

  /**
   * Writes atomically: a temp file in the same directory, then rename over the name (which replaces a symlink
   * there rather than writing through it). A replaced file keeps its owner and mode unless `mode` is given.
   */
  async function write(path: string, body: Readable | Buffer, opts: { mode?: number } = {}): Promise<FileInfo> {
    return withParent(
      path,
      async (parent, name, shown) => {
        const existing = await lstat(at(parent, name)).catch(() => undefined);
        if (existing?.isDirectory()) throw new KilnError("invalid_request", `${shown} is a directory`);
        const keep = existing?.isFile() ? existing : undefined;
        // The temp name says whether a file is being replaced: the watcher then reports the rename as a write.
        const temp = UPLOAD_PREFIX + (keep ? UPLOAD_REPLACES : "n") + randomBytes(6).toString("hex");
        const fh = await open(at(parent, temp), CREATE_FLAGS, 0o600);
        try {
          try {
            await fh.chmod(opts.mode ?? (keep ? keep.mode & 0o7777 : 0o644));
            await fh.chown(keep?.uid ?? VOLUME_OWNER.uid, keep?.gid ?? VOLUME_OWNER.gid);
          } catch (err) {
            await fh.close();
            throw err;
          }
          // The stream closes the handle when it ends or fails (a FileHandle with a live stream cannot be closed first).
          await pipeline(Buffer.isBuffer(body) ? Readable.from([body]) : body, fh.createWriteStream());
          await rename(at(parent, temp), at(parent, name));
        } catch (err) {
          await unlink(at(parent, temp)).catch(() => undefined);
          const code = (err as NodeJS.ErrnoException).code;
          if (code === "ERR_STREAM_PREMATURE_CLOSE" || code === "ECONNRESET") throw new KilnError("invalid_request", "The upload ended early; nothing was written");
          throw err;
        }
        return infoAt(parent, name, shown);
      },
      { mode: 0o755 },
    );
  }

  /** mkdir -p; an existing directory is fine. */
  async function makeDir(path: string, mode = 0o755): Promise<FileInfo> {
    await withDir(path, async () => undefined, { mode });
    return info(path);
  }

  /**
   * rm -r of `name` in `parent`, depth first, never following a symlink. Depth is machine root's to choose (a chain
   * of directories deeper than the server's open-file limit costs a machine a few MB), so at most
   * REMOVE_OPEN_DIRS directories are held open: a deeper one's ancestors are closed and, on the way back up, opened
   * again through `..` and used only if they are still the directory (device and inode) that was left.
   */
  async function removeTree(parent: FileHandle, name: string): Promise<void> {
    const top = await openChildDir(parent, name);
    if (!top) return;
    interface Frame {
      name: string;
      fh: FileHandle | undefined;
      dev: number;
      ino: number;
      names?: string[];
      next: number;
    }
    const stack: Frame[] = [];
    let openCount = 0;
    /** Index of the lowest frame still open (the ones below it were closed to stay within the bound). */
    let lowestOpen = 0;
    const push = async (fh: FileHandle, childName: string) => {
      const st = await fh.stat().catch(async (err: unknown) => {
        await fh.close();
        throw err;
      });
      stack.push({ name: childName, fh, dev: st.dev, ino: st.ino, next: 0 });
      if (++openCount > REMOVE_OPEN_DIRS) {
        const oldest = stack[lowestOpen++];
        await oldest.fh!.close();
        oldest.fh = undefined;
        openCount--;
      }
    };
    try {
      await push(top, name);
      while (stack.length > 0) {
        const frame = stack.at(-1)!;
        const dir = frame.fh!;
        frame.names ??= await readdir(`/proc/self/fd/${dir.fd}`);
        if (frame.next < frame.names.length) {
          const childName = frame.names[frame.next++];
          const sub = await openChildDir(dir, childName);
          if (sub) await push(sub, childName);
          continue;
        }
        // Every child is gone: this directory goes from its parent.
        stack.pop();
        const up = stack.at(-1);
        if (up && !up.fh) {
          const fh = await open(at(dir, ".."), DIR_FLAGS);
          const st = await fh.stat().catch(async (err: unknown) => {
            await fh.close();
            throw err;
          });
          if (st.dev !== up.dev || st.ino !== up.ino) {
            await fh.close();
            throw new KilnError("conflict", "A directory was moved while it was being removed; nothing outside it was touched");
          }
          up.fh = fh;
          openCount++;
          lowestOpen = stack.length - 1;
        }
        await dir.close();
        frame.fh = undefined;
        openCount--;
        await rmdir(at(up ? up.fh! : parent, frame.name)).catch((e: NodeJS.ErrnoException) => (e.code === "ENOENT" ? undefined : Promise.reject(e)));
      }
    } finally {
      for (const f of stack) await f.fh?.close().catch(() => undefined);
    }
  }

  /** The directory `name` in `dir` opened (O_NOFOLLOW); anything else at that name is unlinked, a missing one skipped. */
  async function openChildDir(dir: FileHandle, name: string): Promise<FileHandle | undefined> {
    try {
      return await open(at(dir, name), DIR_FLAGS);
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === "ENOENT") return undefined;
      if (code === "ELOOP" || code === "ENOTDIR") {
        await unlink(at(dir, name)).catch((e: NodeJS.ErrnoException) => (e.code === "ENOENT" ? undefined : Promise.reject(e)));
        return undefined;
      }
      throw err;
    }
  }

  async function remove(path: string, recursive: boolean): Promise<void> {
    await withParent(path, async (parent, name) => {
      const st = await lstat(at(parent, name));
      if (!st.isDirectory()) return unlink(at(parent, name));
      if (recursive) return removeTree(parent, name);
      return rmdir(at(parent, name));
    });
  }

  async function move(src: string, dest: string): Promise<FileInfo> {
    return withParent(src, (srcParent, srcName) =>
      withParent(
        dest,
        async (destParent, destName, destShown) => {
          await lstat(at(srcParent, srcName)).catch((err: unknown) => Promise.reject(failure(err, volumePathOf(volumePathComponents(src)))));
          await rename(at(srcParent, srcName), at(destParent, destName));
          return infoAt(destParent, destName, destShown);
        },
        { mode: 0o755 },
      ),
    );
  }

  /**
   * chmod of a volume file or directory, never through a symlink: the name is lstat'ed, opened with O_NOFOLLOW
   * (non-blocking), and changed through that fd only if it is still the same file or directory.
   */
  async function setMode(path: string, mode: number): Promise<FileInfo> {
    if (volumePathComponents(path).length === 0) {
      return withDir("/", async (dir) => {
        await dir.chmod(mode);
        return describe("/", await dir.stat());
      });
    }
    return withParent(path, async (parent, name, shown) => {
      const before = await lstat(at(parent, name));
      if (!before.isFile() && !before.isDirectory()) throw new KilnError("invalid_request", `${shown} is not a regular file or directory`);
      const fh = await open(at(parent, name), READ_FLAGS);
      try {
        const st = await fh.stat();
        if (st.ino !== before.ino || st.dev !== before.dev) throw new KilnError("conflict", `${shown} changed while its mode was being set`);
        await fh.chmod(mode);
      } finally {
        await fh.close();
      }
      return infoAt(parent, name, shown);
    });
  }

  /** lstat of a volume path, or undefined when it does not exist (watch subscriptions check their path with it). */
  async function exists(path: string): Promise<FileInfo | undefined> {
    return info(path).catch((err: unknown) => {
      if (err instanceof KilnError && err.code === "not_found") return undefined;
      throw err;
    });
  }

  return { info, list, read, write, mkdir: makeDir, remove, move, exists, setMode };
}

export type VolumeFiles = ReturnType<typeof volumeFiles>;
