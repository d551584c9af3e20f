// File operations inside the machine: metadata from lstat with names from the machine's own passwd/group,
// atomic writes (temp file + rename, so a failed upload leaves nothing), listing, mkdir -p, remove, move.

import { createWriteStream } from "node:fs";
import { lstat, readlink, readdir, mkdir, rm, rename, rmdir, unlink, chown, chmod, stat } from "node:fs/promises";
import type { Stats } from "node:fs";
import { pipeline } from "node:stream/promises";
import type { Readable } from "node:stream";
import { basename, dirname, join } from "node:path";
import { randomBytes } from "node:crypto";
import type { FileInfo, UserInfo } from "./protocol.ts";
import { groupName, userName } from "./users.ts";
import { AgentFailure, fsFailure } from "./errors.ts";

/** Uploads are written beside their target under this prefix, then renamed into place (a watch hides them). */
export const UPLOAD_PREFIX = ".kiln-upload-";

function typeOf(st: Stats): FileInfo["type"] {
  if (st.isSymbolicLink()) return "symlink";
  if (st.isDirectory()) return "directory";
  return "file";
}

export async function fileInfo(path: string, st?: Stats): Promise<FileInfo> {
  try {
    st ??= await lstat(path);
    const info: FileInfo = {
      name: basename(path) || "/",
      path,
      is_dir: st.isDirectory(),
      size: st.size,
      type: typeOf(st),
      mode: st.mode.toString(8),
      permissions: (st.mode & 0o7777).toString(8).padStart(4, "0"),
      owner: userName(st.uid),
      group: groupName(st.gid),
      modified_time: st.mtime.toISOString(),
    };
    if (st.isSymbolicLink()) info.symlink_target = await readlink(path);
    return info;
  } catch (err) {
    throw fsFailure(err, path);
  }
}

export async function listDir(path: string, depth: number): Promise<FileInfo[]> {
  const st = await lstat(path).catch((err: unknown) => {
    throw fsFailure(err, path);
  });
  if (!st.isDirectory()) throw new AgentFailure("invalid_request", `${path} is not a directory`);
  const out: FileInfo[] = [];
  async function walk(dir: string, level: number) {
    let names: string[];
    try {
      names = (await readdir(dir)).sort();
    } catch (err) {
      throw fsFailure(err, dir);
    }
    for (const name of names) {
      const p = join(dir, name);
      const s = await lstat(p).catch(() => undefined);
      if (!s) continue; // removed while we listed
      out.push(await fileInfo(p, s));
      if (s.isDirectory() && level < depth) await walk(p, level + 1);
    }
  }
  await walk(path, 1);
  return out;
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

export async function writeFileAtomic(path: string, body: Readable, opts: { mode?: number; owner?: UserInfo }): Promise<FileInfo> {
  const existing = await lstat(path).catch(() => undefined);
  if (existing?.isDirectory()) throw new AgentFailure("invalid_request", `${path} is a directory`);
  await makeDirs(dirname(path), opts.owner);
  // The name tells a watch (src/agent/watch.ts) whether the rename into place replaces a file: r, or n for new.
  const temp = join(dirname(path), `${UPLOAD_PREFIX}${existing ? "r" : "n"}${randomBytes(6).toString("hex")}`);
  try {
    await pipeline(body, createWriteStream(temp, { mode: 0o600 }));
    await chmod(temp, opts.mode ?? (existing ? existing.mode & 0o7777 : 0o644));
    // A file replaced without a named user keeps its owner: the rename must not hand it to root.
    if (opts.owner) await chown(temp, opts.owner.uid, opts.owner.gid);
    else if (existing) await chown(temp, existing.uid, existing.gid);
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
