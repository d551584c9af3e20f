// The one way an image import touches a layer directory: every path is resolved inside one root, one component at
// a time from a directory fd, never following a symlink on any component and never leaving the root — an
// openat-style walk (what filepath-securejoin's handle API and libpathrs do in Go and Rust). Node has no openat, so
// each step opens `/proc/self/fd/<dir fd>/<one name>` with O_NOFOLLOW: the kernel jumps to the directory the fd
// holds and looks up exactly one name in it. Nothing else in src/builder/oci builds a path into a layer.
//
// What Node cannot do by itself (mknod for whiteouts, setxattr) runs as one `mknod` loop or one `setfattr
// --restore` per batch, handed `/proc/<pid>/fd/<n>` paths of directories and files this module opened no-follow:
// the helper acts on exactly the inode that was opened, whatever the layer's names point at.
// Long on purpose: every confined operation (open, mkdir, link, rename, remove) shares the one walk, side by side.

import { execFile, spawn } from "node:child_process";
import { closeSync, constants, fchmodSync, fchownSync, fstatSync, futimesSync, lchownSync, lstatSync, lutimesSync, mkdirSync, openSync, symlinkSync, writeSync } from "node:fs";
import type { Stats } from "node:fs";
import { lstat, mkdir, open, readdir, rmdir, unlink, link } from "node:fs/promises";
import type { FileHandle } from "node:fs/promises";

const { O_RDONLY, O_WRONLY, O_CREAT, O_EXCL, O_DIRECTORY, O_NOFOLLOW, O_NONBLOCK } = constants;
const DIR_FLAGS = O_RDONLY | O_DIRECTORY | O_NOFOLLOW;
/** Directory handles kept open between operations (entries of a tar come grouped by directory). */
const CACHED_DIRS = 64;
/** Files or directories held open for one helper process. */
const BATCH = 200;

/** Ownership and mode of directories the walk creates because an entry needs them. */
export interface ImplicitDir {
  uid: number;
  gid: number;
  mode: number;
}

export interface Attrs {
  uid: number;
  gid: number;
  mode: number;
  mtime: Date;
}

/** A path that runs through something that is not a directory of this root (a symlink or a file on the way). */
export class BlockedPath extends Error {
  readonly at: string;
  readonly kind: "symlink" | "file";
  constructor(at: string, kind: "symlink" | "file") {
    super(`/${at} is a ${kind}, not a directory`);
    this.at = at;
    this.kind = kind;
  }
}

export type EntryKind = "dir" | "file" | "symlink" | "whiteout" | "other";

/** One root directory and the handles of the directories walked to under it. */
export class ConfinedRoot {
  private readonly dirs = new Map<string, FileHandle>();
  private readonly root: FileHandle;
  private readonly implicit: ImplicitDir;

  private constructor(root: FileHandle, implicit: ImplicitDir) {
    this.root = root;
    this.implicit = implicit;
  }

  /** Opens `dir` (a path Kiln chose, trusted) as the root every later relative path is confined to. */
  static async open(dir: string, implicit: ImplicitDir = { uid: 0, gid: 0, mode: 0o755 }): Promise<ConfinedRoot> {
    return new ConfinedRoot(await open(dir, DIR_FLAGS), implicit);
  }

  /** Closes every handle. */
  async close(): Promise<void> {
    const all = [...this.dirs.values(), this.root];
    this.dirs.clear();
    await Promise.all(all.map((h) => h.close().catch(() => {})));
  }

  /** Closes cached directory handles beyond the cache size (oldest first); call between operations. */
  async trim(): Promise<void> {
    while (this.dirs.size > CACHED_DIRS) {
      const [rel, h] = this.dirs.entries().next().value as [string, FileHandle];
      this.dirs.delete(rel);
      await h.close().catch(() => {});
    }
  }

  /** What is at `rel` (not followed), undefined when nothing is; BlockedPath when a parent is not a directory. */
  async kind(rel: string): Promise<EntryKind | undefined> {
    const st = await this.lstat(rel);
    return st && kindOf(st);
  }

  async lstat(rel: string): Promise<Stats | undefined> {
    if (rel === "") return this.root.stat();
    const [parent, name] = await this.parentOf(rel, false);
    if (!parent) return undefined;
    return lstat(at(parent, name)).catch(missing);
  }

  /** Makes sure `rel` is a directory, creating it and missing parents as implicit directories. */
  async ensureDir(rel: string): Promise<void> {
    await this.dir(rel, true);
  }

  /** Makes `rel` a directory (creating missing parents) with the given attributes; an existing directory stays. */
  async mkdir(rel: string, attrs: Omit<Attrs, "mtime">): Promise<void> {
    // Direct system calls, as for small files (see writeSmallFile); only the walk's open stays a promise.
    await this.create(rel, async (path) => {
      try {
        mkdirSync(path, 0o700);
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== "EEXIST" || !lstatSync(path).isDirectory()) throw err;
      }
    });
    const dir = (await this.dir(rel, false))!;
    fchownSync(dir.fd, attrs.uid, attrs.gid);
    fchmodSync(dir.fd, attrs.mode);
  }

  /** Creates the regular file `rel` from `body`, replacing whatever was there; its inode number when `ino` is asked. */
  async writeFile(rel: string, body: AsyncIterable<Buffer>, attrs: Attrs, ino = false): Promise<number | undefined> {
    let fh!: FileHandle;
    await this.create(rel, async (path) => {
      fh = await open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0o600);
    });
    try {
      for await (const chunk of body) await fh.write(chunk);
      await fh.chown(attrs.uid, attrs.gid);
      await fh.chmod(attrs.mode); // after chown, which clears setuid/setgid
      await fh.utimes(attrs.mtime, attrs.mtime);
      return ino ? (await fh.stat()).ino : undefined;
    } finally {
      await fh.close();
    }
  }

  /**
   * `writeFile` for a body already in memory (a small file), in direct system calls: open, write, chown, chmod,
   * times and close cost a few microseconds each on the cache's local disk, where each would cost a thread-pool
   * round trip and an event-loop turn as promises — most of what an image of many small files took to unpack.
   */
  async writeSmallFile(rel: string, data: Buffer, attrs: Attrs, ino = false): Promise<number | undefined> {
    let fd = -1;
    await this.create(rel, async (path) => {
      fd = openSync(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0o600);
    });
    try {
      for (let off = 0; off < data.length; ) off += writeSync(fd, data, off, data.length - off);
      fchownSync(fd, attrs.uid, attrs.gid);
      fchmodSync(fd, attrs.mode); // after chown, which clears setuid/setgid
      futimesSync(fd, attrs.mtime, attrs.mtime);
      return ino ? fstatSync(fd).ino : undefined;
    } finally {
      closeSync(fd);
    }
  }

  /** Creates the symlink `rel` → `target` (kept verbatim, never followed), replacing whatever was there. */
  async symlink(rel: string, target: string, attrs: Omit<Attrs, "mode">): Promise<void> {
    // Direct system calls, as for small files: three of them, each microseconds.
    const path = await this.create(rel, async (p) => symlinkSync(target, p));
    lchownSync(path, attrs.uid, attrs.gid);
    lutimesSync(path, attrs.mtime, attrs.mtime);
  }

  /** Hard-links `rel` to `target`, both inside the root; the target must be a regular file or a symlink. */
  async link(rel: string, target: string): Promise<boolean> {
    // A target under a symlink or file of this root is not a file of it: nothing is followed to find one.
    const [tParent, tName] = await this.parentOf(target, false).catch((err: unknown) => (err instanceof BlockedPath ? ([undefined, ""] as const) : Promise.reject(err)));
    const st = tParent && (await lstat(at(tParent, tName)).catch(missing));
    if (!st || !(st.isFile() || st.isSymbolicLink())) return false;
    if (rel === target) return true;
    let linked = true;
    await this.create(rel, async (path) => {
      // The target's parent may have been closed if making room removed a directory: walk to it again.
      const [again, againName] = await this.parentOf(target, false).catch(() => [undefined, ""] as const);
      if (!again) linked = false;
      else await link(at(again, againName), path);
    });
    return linked;
  }

  /** Removes `rel` and everything under it, following nothing. */
  async remove(rel: string): Promise<void> {
    const [parent, name] = await this.parentOf(rel, false);
    if (!parent) return;
    const st = await lstat(at(parent, name)).catch(missing);
    if (!st) return;
    if (!st.isDirectory()) return unlink(at(parent, name));
    this.forget(rel);
    const dir = await open(at(parent, name), DIR_FLAGS);
    try {
      await emptyDir(dir);
    } finally {
      await dir.close();
    }
    await rmdir(at(parent, name));
  }

  /** Sets a directory's times (after everything inside it is written, which moves them). */
  async setDirTime(rel: string, mtime: Date): Promise<void> {
    const dir = await this.dir(rel, false).catch(() => undefined);
    if (dir) futimesSync(dir.fd, mtime, mtime);
  }

  /**
   * Whiteouts in overlayfs's form: a 0:0 character device at each path (its parent must be a directory of this
   * root; nothing may be there yet), made by one `mknod` loop per batch.
   */
  async mknodWhiteouts(rels: string[]): Promise<void> {
    for (let i = 0; i < rels.length; i += BATCH) {
      const held: FileHandle[] = [];
      try {
        const paths: string[] = [];
        for (const rel of rels.slice(i, i + BATCH)) {
          await this.trim();
          const parent = await this.ownedParent(rel);
          if (!parent) continue;
          held.push(parent.handle);
          paths.push(`${procFd(parent.handle)}/${parent.name}`);
        }
        if (paths.length) await run("sh", ["-c", 'for p; do mknod -- "$p" c 0 0 || exit 1; done', "mknod", ...paths]);
      } finally {
        await Promise.all(held.map((h) => h.close().catch(() => {})));
      }
    }
  }

  /**
   * Extended attributes, set by one `setfattr --restore` per batch on the inodes opened no-follow at each path;
   * an entry whose path now holds another inode than `ino` (a later entry replaced it) or a symlink is skipped.
   * Names must be plain (`[A-Za-z0-9._@:+-]` after the namespace): the caller decides which are allowed.
   */
  async setXattrs(items: { rel: string; ino?: number; attrs: { name: string; value: Buffer }[] }[]): Promise<void> {
    for (let i = 0; i < items.length; i += BATCH) {
      const held: FileHandle[] = [];
      try {
        let dump = "";
        for (const item of items.slice(i, i + BATCH)) {
          await this.trim();
          const fh = await this.openNoFollow(item.rel);
          if (!fh) continue;
          held.push(fh);
          if (item.ino !== undefined && (await fh.stat()).ino !== item.ino) continue;
          const lines = item.attrs.filter((a) => PLAIN_XATTR.test(a.name)).map((a) => `${a.name}=0x${a.value.toString("hex")}\n`);
          if (lines.length) dump += `# file: ${procFd(fh)}\n${lines.join("")}\n`;
        }
        if (dump) await run("setfattr", ["--restore=-"], dump);
      } finally {
        await Promise.all(held.map((h) => h.close().catch(() => {})));
      }
    }
  }

  /** One extended attribute of `rel` (not followed), or undefined. */
  async getXattr(rel: string, name: string): Promise<Buffer | undefined> {
    if (!PLAIN_XATTR.test(name)) return undefined;
    const fh = await this.openNoFollow(rel);
    if (!fh) return undefined;
    try {
      return await new Promise<Buffer | undefined>((resolve) =>
        execFile("getfattr", ["--only-values", "-n", name, procFd(fh)], { encoding: "buffer", maxBuffer: 1 << 20 }, (err, out) => resolve(err ? undefined : out)),
      );
    } finally {
      await fh.close();
    }
  }

  /** The content of the regular file `rel` (not followed), at most `max` bytes; undefined if it is not one. */
  async readFile(rel: string, max: number): Promise<Buffer | undefined> {
    const fh = await this.openNoFollow(rel);
    if (!fh) return undefined;
    try {
      const st = await fh.stat();
      if (!st.isFile()) return undefined;
      if (st.size > max) throw new RangeError(`/${rel} is larger than ${max} bytes`);
      return await fh.readFile();
    } finally {
      await fh.close();
    }
  }

  // ── the walk ───────────────────────────────────────────────────────────────────────────────────────────────

  /** The handle of the directory `rel` ("" is the root): undefined when missing and not `create`d. */
  private async dir(rel: string, create: boolean): Promise<FileHandle | undefined> {
    if (rel === "") return this.root;
    const parts = split(rel);
    let k = parts.length;
    let handle = this.root;
    for (; k > 0; k--) {
      const hit = this.dirs.get(parts.slice(0, k).join("/"));
      if (hit) {
        handle = hit;
        break;
      }
    }
    for (; k < parts.length; k++) {
      const name = parts[k];
      const prefix = parts.slice(0, k + 1).join("/");
      let next: FileHandle;
      try {
        next = await open(at(handle, name), DIR_FLAGS);
      } catch (err) {
        const code = (err as NodeJS.ErrnoException).code;
        if (code === "ENOENT" && create) {
          await mkdir(at(handle, name), 0o700);
          next = await open(at(handle, name), DIR_FLAGS);
          await next.chown(this.implicit.uid, this.implicit.gid);
          await next.chmod(this.implicit.mode);
        } else if (code === "ENOENT") {
          return undefined;
        } else if (code === "ENOTDIR" || code === "ELOOP") {
          const st = await lstat(at(handle, name));
          throw new BlockedPath(prefix, st.isSymbolicLink() ? "symlink" : "file");
        } else throw err;
      }
      this.dirs.set(prefix, next);
      handle = next;
    }
    return handle;
  }

  /** The parent directory's handle and the last name of `rel`. */
  private async parentOf(rel: string, create: boolean): Promise<[FileHandle | undefined, string]> {
    const parts = split(rel);
    const name = parts.pop()!;
    return [await this.dir(parts.join("/"), create), name];
  }

  /**
   * Runs `make` on the path of `rel` in its parent (created if missing). Something already there (EEXIST) is
   * removed and `make` runs once more: a later tar entry replaces an earlier one. Returns the path `make` used.
   */
  private async create(rel: string, make: (path: string) => Promise<void>): Promise<string> {
    const [parent, name] = await this.parentOf(rel, true);
    try {
      await make(at(parent!, name));
      return at(parent!, name);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== "EEXIST") throw err;
    }
    await this.remove(rel);
    const [again] = await this.parentOf(rel, true);
    await make(at(again!, name));
    return at(again!, name);
  }

  /** A handle of its own (the caller closes it) on the parent directory of `rel`, or undefined when there is none. */
  private async ownedParent(rel: string): Promise<{ handle: FileHandle; name: string } | undefined> {
    const [parent, name] = await this.parentOf(rel, false).catch(() => [undefined, ""] as const);
    if (!parent) return undefined;
    // Re-opening the fd's own magic link (followed: it names exactly that directory) gives a handle of its own.
    return { handle: await open(procFd(parent, true), O_RDONLY | O_DIRECTORY), name };
  }

  /** A handle of its own on what is at `rel`, opened without following it; undefined for a symlink or nothing. */
  private async openNoFollow(rel: string): Promise<FileHandle | undefined> {
    if (rel === "") return open(procFd(this.root, true), O_RDONLY | O_DIRECTORY);
    const [parent, name] = await this.parentOf(rel, false).catch(() => [undefined, ""] as const);
    if (!parent) return undefined;
    return open(at(parent, name), O_RDONLY | O_NOFOLLOW | O_NONBLOCK).catch(() => undefined);
  }

  /** Drops cached handles of `rel` and everything under it (it is being removed). */
  private forget(rel: string): void {
    for (const [key, h] of this.dirs) {
      if (key === rel || key.startsWith(`${rel}/`)) {
        this.dirs.delete(key);
        void h.close().catch(() => {});
      }
    }
  }
}

/** Names Kiln's own batches may carry to setfattr: a namespace, then plain characters (no line breaks, no `=`). */
const PLAIN_XATTR = /^(user|security|trusted)\.[A-Za-z0-9._@:+-]{1,200}$/;

function split(rel: string): string[] {
  const parts = rel.split("/");
  for (const p of parts) {
    if (!p || p === "." || p === ".." || p.includes("\0")) throw new Error(`not a clean relative path: ${JSON.stringify(rel)}`);
  }
  return parts;
}

/** The one place a path into the root is spelled: one name looked up in the directory an fd holds. */
function at(dir: FileHandle, name: string): string {
  if (!name || name === "." || name === ".." || name.includes("/") || name.includes("\0")) throw new Error(`not a single name: ${JSON.stringify(name)}`);
  return `/proc/self/fd/${dir.fd}/${name}`;
}

/** The fd's magic link, as this process (`self`) or a helper process (its pid) reaches it. */
function procFd(h: FileHandle, self = false): string {
  return `/proc/${self ? "self" : process.pid}/fd/${h.fd}`;
}

function kindOf(st: Stats): EntryKind {
  if (st.isDirectory()) return "dir";
  if (st.isFile()) return "file";
  if (st.isSymbolicLink()) return "symlink";
  if (st.isCharacterDevice() && st.rdev === 0) return "whiteout";
  return "other";
}

function missing(err: NodeJS.ErrnoException): undefined {
  if (err.code === "ENOENT") return undefined;
  throw err;
}

/** Removes everything inside the directory `dir` holds, descending by handles, following nothing. */
async function emptyDir(dir: FileHandle): Promise<void> {
  for (const name of await readdir(procFd(dir, true))) {
    const path = at(dir, name);
    const st = await lstat(path).catch(missing);
    if (!st) continue;
    if (!st.isDirectory()) {
      await unlink(path);
      continue;
    }
    const sub = await open(path, DIR_FLAGS);
    try {
      await emptyDir(sub);
    } finally {
      await sub.close();
    }
    await rmdir(path);
  }
}

function run(cmd: string, args: string[], input?: string): Promise<void> {
  return new Promise((resolve, reject) => {
    const child = spawn(cmd, args, { stdio: [input === undefined ? "ignore" : "pipe", "ignore", "pipe"] });
    let err = "";
    child.stderr!.on("data", (c) => (err = (err + c).slice(-2000)));
    child.on("error", (e) => reject(new Error(`${cmd} could not run (${e.message}); is it installed?`)));
    child.on("close", (code) => (code === 0 ? resolve() : reject(new Error(`${cmd} failed: ${err.trim()}`))));
    if (input !== undefined) {
      child.stdin!.on("error", () => {}); // a helper that exits early reports through its exit code
      child.stdin!.end(input);
    }
  });
}
