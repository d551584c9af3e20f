// One image layer (a tar, raw or gzip or zstd) written out as a directory overlayfs can stack: ownership shifted
// into the machines' uid range, OCI whiteouts in overlayfs's own form, nothing outside the directory ever touched.

import { spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { constants, createReadStream } from "node:fs";
import { chmod, lchown, link, lstat, lutimes, mkdir, open, rm, symlink, utimes, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { Transform } from "node:stream";
import type { Readable } from "node:stream";
import { pipeline } from "node:stream/promises";
import { createGunzip, createZstdDecompress } from "node:zlib";
import { extract } from "tar-stream";
import type { Header as Headers } from "tar-stream";
import { HOST_ID_BASE, ID_RANGE } from "../../runtime/oci/idmap.ts";
import { importError } from "./types.ts";
import type { LayerCompression } from "./types.ts";

/** Top-level directories the machine mounts at boot: whatever a layer puts there is dropped. */
const MACHINE_PROVIDED = new Set(["dev", "proc", "sys"]);
const WHITEOUT = ".wh.";
const OPAQUE = ".wh..wh..opq";
const NOBODY = 65_534;
/** zlib's default 16 KiB output chunks cost a thread-pool round trip each; 256 KiB inflates ~1.5× faster here. */
const INFLATE_CHUNK = 256 << 10;

export interface UnpackResult {
  /** sha256 of the uncompressed tar: the layer's diff id. */
  diffId: string;
  files: number;
}

/**
 * Unpacks `source` into the empty directory `dest`. Refuses (build_error naming the path) special files, entries
 * that would leave `dest`, hard links to anything not already in this layer, and a diff id other than `expectDiffId`.
 */
export async function unpackLayer(source: string | Readable, compression: LayerCompression, dest: string, expectDiffId?: string): Promise<UnpackResult> {
  await mkdir(dest, { recursive: true });
  await lchown(dest, HOST_ID_BASE, HOST_ID_BASE);
  await chmod(dest, 0o755);
  const input = typeof source === "string" ? createReadStream(source, { highWaterMark: 1 << 20 }) : source;
  const hash = createHash("sha256");
  const tap = new Transform({
    transform(chunk, _enc, cb) {
      hash.update(chunk);
      cb(null, chunk);
    },
  });
  const ex = extract();
  const piping =
    compression === "gzip"
      ? pipeline(input, createGunzip({ chunkSize: INFLATE_CHUNK }), tap, ex)
      : compression === "zstd"
        ? pipeline(input, createZstdDecompress({ chunkSize: INFLATE_CHUNK }), tap, ex)
        : pipeline(input, tap, ex);
  const state: LayerState = { dest, dirs: new Set([""]), written: new Set(), dirTimes: [], xattrs: [], whiteouts: [], files: 0 };
  try {
    for await (const entry of ex) {
      try {
        await writeEntry(state, entry.header, entry as unknown as Readable);
      } finally {
        entry.resume();
      }
    }
    await piping;
  } catch (err) {
    ex.destroy();
    await piping.catch(() => {});
    if ((err as { detail?: unknown }).detail) throw err;
    throw importError(`a layer could not be unpacked: ${(err as Error).message}`);
  }
  const diffId = `sha256:${hash.digest("hex")}`;
  if (expectDiffId && diffId !== expectDiffId) throw importError(`a layer's content (${diffId}) does not match the diff id ${expectDiffId} the image config records`);
  await applyWhiteouts(dest, state.whiteouts);
  await applyXattrs(dest, state.xattrs);
  // Directory times last, deepest first: writing inside a directory moves its mtime.
  for (const [rel, mtime] of state.dirTimes.reverse()) await utimes(join(dest, rel), mtime, mtime);
  return { diffId, files: state.files };
}

interface LayerState {
  dest: string;
  /** Directories (relative paths) known to be real directories of this layer, never symlinks. */
  dirs: Set<string>;
  /** Every non-directory path written so far: the layer dir starts empty, so only these can need replacing. */
  written: Set<string>;
  dirTimes: [string, Date][];
  xattrs: { rel: string; name: string; value: Buffer }[];
  whiteouts: string[];
  files: number;
}

/** `a/./b/` → `a/b`; anything that climbs above the root is refused. */
export function entryPath(name: string): string {
  const parts: string[] = [];
  for (const p of name.split("/")) {
    if (!p || p === ".") continue;
    if (p === "..") {
      if (!parts.length) throw importError(`layer entry ${JSON.stringify(name)} escapes the image root`);
      parts.pop();
    } else parts.push(p);
  }
  return parts.join("/");
}

function shift(id: number | undefined): number {
  const n = id ?? 0;
  return HOST_ID_BASE + (n >= 0 && n < ID_RANGE ? n : NOBODY);
}

async function writeEntry(state: LayerState, h: Headers, body: Readable): Promise<void> {
  const rel = entryPath(h.name);
  if (!rel) return; // the root itself: the layer directory keeps Kiln's root ownership and mode
  const top = rel.split("/")[0];
  if (MACHINE_PROVIDED.has(top) && rel !== top) return;
  const slash = rel.lastIndexOf("/");
  const parent = slash >= 0 ? rel.slice(0, slash) : "";
  const base = rel.slice(slash + 1);
  await ensureDir(state, parent, rel);
  const abs = join(state.dest, rel);
  const uid = shift(h.uid);
  const gid = shift(h.gid);
  const mode = (h.mode ?? 0o644) & 0o7777;
  const mtime = h.mtime ?? new Date(0);

  if (base === OPAQUE) {
    state.xattrs.push({ rel: parent || ".", name: "trusted.overlay.opaque", value: Buffer.from("y") });
    return;
  }
  if (base.startsWith(WHITEOUT)) {
    const hidden = parent ? `${parent}/${base.slice(WHITEOUT.length)}` : base.slice(WHITEOUT.length);
    if (!base.slice(WHITEOUT.length)) throw importError(`layer entry ${JSON.stringify(h.name)} is a whiteout without a name`);
    state.whiteouts.push(hidden);
    return;
  }

  switch (h.type) {
    case "directory": {
      if (!state.dirs.has(rel)) {
        if (state.written.delete(rel)) await replaceable(abs, true);
        await mkdir(abs).catch((e) => (e.code === "EEXIST" ? undefined : Promise.reject(e)));
        state.dirs.add(rel);
      }
      await lchown(abs, uid, gid);
      await chmod(abs, mode);
      state.dirTimes.push([rel, mtime]);
      break;
    }
    case "file":
    case "contiguous-file": {
      await replace(state, rel, abs);
      const fh = await open(abs, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW, 0o600);
      try {
        for await (const chunk of body) await fh.write(chunk as Buffer);
        await fh.chown(uid, gid);
        await fh.chmod(mode); // after chown, which clears setuid/setgid
        await fh.utimes(mtime, mtime);
      } finally {
        await fh.close();
      }
      state.files++;
      break;
    }
    case "symlink": {
      await replace(state, rel, abs);
      await symlink(h.linkname ?? "", abs); // the target is kept verbatim and never followed
      await lchown(abs, uid, gid);
      await lutimes(abs, mtime, mtime);
      break;
    }
    case "link": {
      const target = entryPath(h.linkname ?? "");
      const st = target ? await lstat(join(state.dest, target)).catch(() => undefined) : undefined;
      if (!st || st.isDirectory()) throw importError(`layer entry ${JSON.stringify(h.name)} is a hard link to ${JSON.stringify(h.linkname)}, which is not a file in the same layer`);
      await replace(state, rel, abs);
      await link(join(state.dest, target), abs);
      break;
    }
    case "character-device":
    case "block-device":
    case "fifo":
      throw importError(`layer entry /${rel} is a ${h.type.replace("-", " ")}: OCI special files are not supported in imported images`);
    default:
      throw importError(`layer entry /${rel} has an unsupported type (${h.type})`);
  }
  if (h.type !== "symlink" && h.type !== "link") {
    for (const [key, value] of Object.entries(h.pax ?? {})) {
      if (!key.startsWith("SCHILY.xattr.")) continue;
      const name = key.slice("SCHILY.xattr.".length);
      // trusted.* is overlayfs's own namespace (opaque, redirect): a layer never gets to set it.
      if (typeof value !== "string" || !/^(user|security)\./.test(name) || value.includes("\uFFFD")) continue;
      state.xattrs.push({ rel, name, value: Buffer.from(value, "utf8") });
    }
  }
}

/**
 * Makes sure `rel` is a real directory of this layer, creating missing ones (root-owned, 0755). A parent that is
 * a symlink or a file is refused: writing through it could land outside the layer.
 */
async function ensureDir(state: LayerState, rel: string, entry: string): Promise<void> {
  if (state.dirs.has(rel)) return;
  const slash = rel.lastIndexOf("/");
  await ensureDir(state, slash >= 0 ? rel.slice(0, slash) : "", entry);
  const abs = join(state.dest, rel);
  const st = await lstat(abs).catch(() => undefined);
  if (!st) {
    await mkdir(abs);
    await chmod(abs, 0o755); // by hand: Kiln's umask (077) would leave it 0700, closed to the machines' users
    await lchown(abs, HOST_ID_BASE, HOST_ID_BASE);
  } else if (!st.isDirectory()) {
    throw importError(`layer entry /${entry} lies under /${rel}, which this layer made a ${st.isSymbolicLink() ? "symlink" : "file"}`);
  }
  state.dirs.add(rel);
}

/** Clears the way for a non-directory at `rel`: only a path this layer already wrote (or a directory) can be there. */
async function replace(state: LayerState, rel: string, abs: string): Promise<void> {
  if (state.written.has(rel) || state.dirs.has(rel)) {
    await replaceable(abs, false);
    state.dirs.delete(rel);
    for (const d of state.dirs) if (d.startsWith(`${rel}/`)) state.dirs.delete(d);
  }
  state.written.add(rel);
}

/** A later entry for the same path replaces the earlier one (a directory stays when a directory comes again). */
async function replaceable(abs: string, keepDir: boolean): Promise<void> {
  const st = await lstat(abs).catch(() => undefined);
  if (!st || (keepDir && st.isDirectory())) return;
  await rm(abs, { recursive: true, force: true });
}

/** `.wh.<name>` becomes what overlayfs reads as a whiteout: a 0:0 character device (one mknod process per layer). */
async function applyWhiteouts(dest: string, paths: string[]): Promise<void> {
  if (!paths.length) return;
  for (const p of paths) await rm(join(dest, p), { recursive: true, force: true });
  await run("sh", ["-c", 'for p; do mknod -- "$p" c 0 0 || exit 1; done', "mknod", ...paths.map((p) => `./${p}`)], dest);
}

/** Extended attributes (the opaque marker and the tar's SCHILY.xattr records), set by one `setfattr --restore`. */
async function applyXattrs(dest: string, xattrs: LayerState["xattrs"]): Promise<void> {
  if (!xattrs.length) return;
  const dump = xattrs.map((x) => `# file: ${escapePath(x.rel)}\n${x.name}=0x${x.value.toString("hex")}\n`).join("\n");
  const file = join(dest, "..", `.xattrs-${process.pid}-${Date.now()}`);
  await writeFile(file, dump + "\n", { mode: 0o600 });
  try {
    await run("setfattr", ["-h", `--restore=${file}`], dest);
  } finally {
    await rm(file, { force: true });
  }
}

/** getfattr's dump escapes: backslash and control characters as octal. */
function escapePath(rel: string): string {
  return Array.from(Buffer.from(rel), (b) => (b < 0x21 || b === 0x5c || b >= 0x7f ? `\\${b.toString(8).padStart(3, "0")}` : String.fromCharCode(b))).join("");
}

function run(cmd: string, args: string[], cwd: string): Promise<void> {
  return new Promise((resolve, reject) => {
    const child = spawn(cmd, args, { cwd, stdio: ["ignore", "ignore", "pipe"] });
    let err = "";
    child.stderr.on("data", (c) => (err = (err + c).slice(-2000)));
    child.on("error", (e) => reject(importError(`${cmd} could not run (${e.message}); is it installed?`)));
    child.on("close", (code) => (code === 0 ? resolve() : reject(importError(`${cmd} failed while writing a layer: ${err.trim()}`))));
  });
}
