// File operations inside the machine: metadata from lstat with names from the machine's own passwd/group,
// atomic writes (temp file + rename, so a failed upload leaves nothing), listing, mkdir -p, remove, move.

import { constants as fsc, createWriteStream } from "node:fs";
import { lstat, open, readlink, readdir, mkdir, realpath, rm, rename, rmdir, unlink, chown, chmod, stat, readFile, writeFile } from "node:fs/promises";
import type { FileHandle } from "node:fs/promises";
import type { Stats } from "node:fs";
import { pipeline } from "node:stream/promises";
import type { Readable } from "node:stream";
import { dirname, join } from "node:path";
import type { FileInfo, UserInfo } from "./protocol.ts";
import { groupName, userName } from "./users.ts";
import { AgentFailure, fsFailure } from "./errors.ts";
import { dirNames, listPage } from "./list-pages.ts";
import { statToFileInfo } from "./file-info.ts";
import type { OwnerNames } from "./file-info.ts";
import type { TreeSource } from "./list-pages.ts";
import { readMetadata, writeMetadata } from "./xattr-metadata.ts";

/** Uploads are written beside their target under this prefix, then renamed into place (a watch hides them). */
export const UPLOAD_PREFIX = ".kiln-upload-";

/**
 * Where a filesystem keeps no user xattrs (gVisor's root, whose overlay refuses them), metadata is kept in the
 * machine beside its files instead: one record per inode under this directory, so it still follows the file through
 * renames and moves and outlasts a stop/resume. A record names the file's birth time too: a later file that reuses
 * a freed inode does not inherit it. Records of deleted files stay behind (small, never matched again).
 */
export const METADATA_DIR = "/var/lib/kiln/file-metadata";
type MetadataRecord = { birth: number; metadata: Record<string, string> };
let metadataRecords: Promise<Map<string, MetadataRecord>> | undefined;

const inodeKey = (st: Stats) => `${st.dev}-${st.ino}`;

function loadMetadataRecords(): Promise<Map<string, MetadataRecord>> {
  return (metadataRecords ??= (async () => {
    const map = new Map<string, MetadataRecord>();
    const names = await readdir(METADATA_DIR).catch(() => [] as string[]);
    for (const name of names) {
      if (!name.endsWith(".json")) continue;
      const rec = await readFile(join(METADATA_DIR, name), "utf8").then(JSON.parse, () => undefined);
      if (rec && typeof rec.birth === "number" && rec.metadata && typeof rec.metadata === "object") map.set(name.slice(0, -5), rec);
    }
    return map;
  })());
}

async function recordedMetadata(st: Stats): Promise<Record<string, string> | undefined> {
  const rec = (await loadMetadataRecords()).get(inodeKey(st));
  return rec && rec.birth === st.birthtimeMs ? rec.metadata : undefined;
}

async function recordMetadata(st: Stats, metadata: Record<string, string>): Promise<void> {
  const map = await loadMetadataRecords();
  const key = inodeKey(st);
  const rec: MetadataRecord = { birth: st.birthtimeMs, metadata };
  await mkdir(METADATA_DIR, { recursive: true, mode: 0o700 });
  await writeFile(join(METADATA_DIR, `${key}.json`), JSON.stringify(rec), { mode: 0o600 });
  map.set(key, rec);
}

/** A file's metadata: its `user.e2b.*` xattrs (through a symlink, as envd), else its record if it has one. */
async function metadataOf(path: string, st: Stats): Promise<Record<string, string> | undefined> {
  const target = st.isSymbolicLink() ? await realpath(path).catch(() => undefined) : path;
  if (target === undefined) return undefined;
  // (gVisor lists no xattrs rather than refusing the call: a file with none is looked up in the records too.)
  const fromXattrs = readMetadata(target);
  if (fromXattrs) return fromXattrs;
  const targetSt = target === path ? st : await stat(target).catch(() => undefined);
  return targetSt && recordedMetadata(targetSt);
}

/** Owner and group names by id; a listing passes memoised ones (one look at passwd/group per page, not per entry). */
const currentOwnerNames: OwnerNames = { user: userName, group: groupName };

function memoisedOwnerNames(): OwnerNames {
  const users = new Map<number, string>();
  const groups = new Map<number, string>();
  return {
    user: (uid) => users.get(uid) ?? users.set(uid, userName(uid)).get(uid)!,
    group: (gid) => groups.get(gid) ?? groups.set(gid, groupName(gid)).get(gid)!,
  };
}

/** A regular file opened for reading, for GET /files; anything else is refused. */
export async function openForDownload(path: string): Promise<FileHandle> {
  const st = await lstat(path).catch(() => undefined);
  if (!st) throw new AgentFailure("not_found", `No such file: ${path}`);
  if (st.isDirectory()) throw new AgentFailure("invalid_request", `${path} is a directory (use files/list)`);
  // O_NONBLOCK: opening a FIFO (or a device) must not hold one of the few I/O threads every file call shares.
  const fh = await open(path, fsc.O_RDONLY | fsc.O_NONBLOCK).catch((err: NodeJS.ErrnoException) => {
    throw err.code === "EACCES" ? new AgentFailure("forbidden", `Permission denied: ${path}`) : new AgentFailure("not_found", `Cannot read ${path}`);
  });
  const opened = await fh.stat().catch(() => undefined);
  if (!opened?.isFile()) {
    await fh.close();
    throw new AgentFailure("invalid_request", `${path} is not a regular file`);
  }
  return fh;
}

export async function fileInfo(path: string, st?: Stats, names: OwnerNames = currentOwnerNames): Promise<FileInfo> {
  try {
    st ??= await lstat(path);
    const info = statToFileInfo(path, st, names, st.isSymbolicLink() ? await readlink(path) : undefined);
    const metadata = await metadataOf(path, st);
    if (metadata) info.metadata = metadata;
    return info;
  } catch (err) {
    throw fsFailure(err, path);
  }
}

/** The machine's directories by path, for paged listings (list-pages.ts); owner names looked up once per page. */
function machineTree(): TreeSource<string, FileInfo> {
  const names = memoisedOwnerNames();
  return {
    async *names(dir) {
      try {
        yield* dirNames(dir);
      } catch (err) {
        throw fsFailure(err, dir);
      }
    },
    async entry(dir, name) {
      const p = join(dir, name);
      const st = await lstat(p).catch(() => undefined);
      return st ? { entry: await fileInfo(p, st, names), isDir: st.isDirectory() } : undefined;
    },
    async open(dir, name) {
      const p = join(dir, name);
      return (await lstat(p).catch(() => undefined))?.isDirectory() ? p : undefined;
    },
    async close() {},
  };
}

/** One page of the listing of `path`, `depth` deep: see list-pages.ts. */
export async function listDir(path: string, depth: number, page: { limit: number; after?: string[] }): Promise<{ entries: FileInfo[]; next?: string[] }> {
  const st = await lstat(path).catch((err: unknown) => {
    throw fsFailure(err, path);
  });
  if (!st.isDirectory()) throw new AgentFailure("invalid_request", `${path} is not a directory`);
  return listPage(machineTree(), path, { depth, ...page });
}

/** mkdir -p; directories it creates belong to `owner`. */
export async function makeDirs(path: string, owner: UserInfo | undefined, mode = 0o755): Promise<void> {
  const missing: string[] = [];
  let p = path;
  for (;;) {
    const s = await stat(p).catch((err: NodeJS.ErrnoException) => (err.code === "ENOENT" ? undefined : Promise.reject(fsFailure(err, p))));
    if (s) {
      if (!s.isDirectory()) throw new AgentFailure("invalid_request", `${p} exists and is not a directory`);
      break;
    }
    missing.push(p);
    const parent = dirname(p);
    if (parent === p) break;
    p = parent;
  }
  for (const dir of missing.reverse()) {
    try {
      await mkdir(dir, { mode });
      await chmod(dir, mode);
      if (owner) await chown(dir, owner.uid, owner.gid);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== "EEXIST") throw fsFailure(err, dir);
    }
  }
}

export async function writeFileAtomic(path: string, body: Readable, opts: { mode?: number; owner?: UserInfo; metadata?: Record<string, string> }): Promise<FileInfo> {
  const existing = await lstat(path).catch(() => undefined);
  if (existing?.isDirectory()) throw new AgentFailure("invalid_request", `${path} is a directory`);
  await makeDirs(dirname(path), opts.owner);
  // The name tells a watch (src/agent/watch.ts) whether the rename into place replaces a file: r, or n for new.
  const temp = join(dirname(path), `${UPLOAD_PREFIX}${existing ? "r" : "n"}${process.getBuiltinModule("node:crypto").randomBytes(6).toString("hex")}`);
  try {
    await pipeline(body, createWriteStream(temp, { mode: 0o600 }));
    await chmod(temp, opts.mode ?? (existing ? existing.mode & 0o7777 : 0o644));
    // A file replaced without a named user keeps its owner: the rename must not hand it to root.
    if (opts.owner) await chown(temp, opts.owner.uid, opts.owner.gid);
    else if (existing) await chown(temp, existing.uid, existing.gid);
    // Set on the temp file, whose inode the rename keeps: the file appears with its metadata (and a rewrite, being
    // a new file, has only what it sent, as envd's upload replaces the whole set).
    if (opts.metadata && Object.keys(opts.metadata).length > 0 && !(await writeMetadata(temp, opts.metadata))) await recordMetadata(await lstat(temp), opts.metadata);
    await rename(temp, path);
  } catch (err) {
    await unlink(temp).catch(() => undefined);
    if (err instanceof AgentFailure) throw err;
    if ((err as NodeJS.ErrnoException).code === "ERR_STREAM_PREMATURE_CLOSE" || (err as NodeJS.ErrnoException).code === "ECONNRESET") {
      throw new AgentFailure("invalid_request", "The upload ended early; nothing was written");
    }
    throw fsFailure(err, path);
  }
  return fileInfo(path);
}

export async function remove(path: string, recursive: boolean): Promise<void> {
  try {
    const st = await lstat(path);
    if (st.isDirectory()) {
      if (recursive) await rm(path, { recursive: true, force: true });
      else await rmdir(path);
    } else await unlink(path);
  } catch (err) {
    throw fsFailure(err, path);
  }
}

export async function move(src: string, dest: string, owner: UserInfo | undefined): Promise<FileInfo> {
  await lstat(src).catch((err: unknown) => {
    throw fsFailure(err, src);
  });
  await makeDirs(dirname(dest), owner);
  try {
    await rename(src, dest);
  } catch (err) {
    throw fsFailure(err, dest);
  }
  return fileInfo(dest);
}
