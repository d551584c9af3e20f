// One image layer (a tar, raw or gzip or zstd) written out as a directory overlayfs can stack: ownership shifted
// into the machines' uid range, OCI whiteouts in overlayfs's own form. Every filesystem operation goes through a
// ConfinedRoot on the layer dir, so nothing a layer's names or symlinks say can reach outside it.

import { createHash } from "node:crypto";
import { createReadStream } from "node:fs";
import { chmod, lchown, mkdir } from "node:fs/promises";
import { Readable, Transform } from "node:stream";
import { pipeline } from "node:stream/promises";
import { createGunzip, createZstdDecompress } from "node:zlib";
import { extract } from "tar-stream";
import type { Header as Headers } from "tar-stream";
import { HOST_ID_BASE, ID_RANGE } from "../../runtime/oci/idmap.ts";
import { BlockedPath, ConfinedRoot } from "./confined-root.ts";
import { ByteBudget, DEFAULT_IMPORT_LIMITS, overLimit } from "./limits.ts";
import type { ImportLimits } from "./limits.ts";
import { importError } from "./types.ts";
import type { LayerCompression } from "./types.ts";

/** Top-level directories the machine mounts at boot: whatever a layer puts there is dropped. */
const MACHINE_PROVIDED = new Set(["dev", "proc", "sys"]);
const WHITEOUT = ".wh.";
const OPAQUE = ".wh..wh..opq";
const NOBODY = 65_534;
/** Linux's PATH_MAX and NAME_MAX: a longer entry could never be used in a machine. */
const PATH_MAX = 4096;
const NAME_MAX = 255;
/** Files up to this size are read whole from the tar and written in direct system calls (see writeSmallFile). */
const SMALL_FILE = 64 << 10;
/** zlib's default 16 KiB output chunks cost a thread-pool round trip each; 256 KiB inflates ~1.5× faster here. */
const INFLATE_CHUNK = 256 << 10;

export interface UnpackResult {
  /** sha256 of the uncompressed tar: the layer's diff id. */
  diffId: string;
  files: number;
}

export interface UnpackOptions {
  /** The diff id the image config records; a layer whose tar hashes otherwise is refused. */
  expectDiffId?: string;
  limits?: ImportLimits;
  /** The import's running count of uncompressed bytes (shared by its layers). */
  budget?: ByteBudget;
  signal?: AbortSignal;
}

/**
 * Unpacks `source` into the empty directory `dest`. Refuses (build_error naming the path) special files, entries
 * that would leave `dest` or lie under a symlink or file of this layer, hard links to anything not already in this
 * layer, anything over its limit, and a diff id other than `expectDiffId`. Every failure, a stream's included, is
 * a build_error; `dest` is then the caller's to remove.
 */
export async function unpackLayer(source: string | Readable | AsyncIterable<Buffer>, compression: LayerCompression, dest: string, opts: UnpackOptions = {}): Promise<UnpackResult> {
  const limits = opts.limits ?? DEFAULT_IMPORT_LIMITS;
  const budget = opts.budget ?? new ByteBudget(limits);
  await mkdir(dest, { recursive: true });
  await lchown(dest, HOST_ID_BASE, HOST_ID_BASE);
  await chmod(dest, 0o755);
  const root = await ConfinedRoot.open(dest, { uid: HOST_ID_BASE, gid: HOST_ID_BASE, mode: 0o755 });
  const input = typeof source === "string" ? createReadStream(source, { highWaterMark: 1 << 20 }) : source instanceof Readable ? source : Readable.from(source, { objectMode: false });
  const hash = createHash("sha256");
  const tap = new Transform({
    transform(chunk: Buffer, _enc, cb) {
      try {
        budget.take(chunk.length);
      } catch (err) {
        return cb(err as Error);
      }
      hash.update(chunk);
      cb(null, chunk);
    },
  });
  const ex = extract();
  // The iterator listens from here on: a tar that fails (or a cancel) before the first entry ends it too. Made
  // after an await, it could miss the extractor's 'close' and wait forever.
  const entries = ex[Symbol.asyncIterator]();
  const streams = compression === "gzip" ? [createGunzip({ chunkSize: INFLATE_CHUNK })] : compression === "zstd" ? [createZstdDecompress({ chunkSize: INFLATE_CHUNK })] : [];
  const piping = pipeline([input, ...streams, tap, ex], { signal: opts.signal });
  // The stream may fail while an entry is being written (a truncated tar, a corrupt gzip): that rejection is
  // handled below, and must never be left unhandled, which would end the whole process.
  piping.catch(() => {});
  const layer = new LayerWriter(root, limits);
  try {
    for await (const entry of { [Symbol.asyncIterator]: () => entries }) {
      try {
        await root.trim();
        await layer.write(entry.header, entry as unknown as Readable);
      } finally {
        entry.resume();
      }
    }
    await piping;
    const diffId = `sha256:${hash.digest("hex")}`;
    if (opts.expectDiffId && diffId !== opts.expectDiffId) throw importError(`a layer's content (${diffId}) does not match the diff id ${opts.expectDiffId} the image config records`);
    await layer.finish();
    return { diffId, files: layer.files };
  } catch (err) {
    ex.destroy();
    const cause = await piping.then(() => undefined, (e: unknown) => e);
    throw asImportError(opts.signal?.aborted ? importError("the import was cancelled") : (err as Error), cause);
  } finally {
    await root.close();
  }
}

/**
 * What one layer's entries do to its directory, in tar order; what must wait for the whole layer (whiteouts,
 * opaque markers, extended attributes, directory times) is recorded by path and applied by `finish`, through the
 * same confined root, to what is then at that path.
 */
class LayerWriter {
  files = 0;
  private entries = 0;
  private readonly whiteouts = new Set<string>();
  private readonly opaque = new Set<string>();
  private readonly xattrs = new Map<string, { ino?: number; attrs: { name: string; value: Buffer }[] }>();
  private readonly dirTimes = new Map<string, Date>();
  private readonly root: ConfinedRoot;
  private readonly limits: ImportLimits;

  constructor(root: ConfinedRoot, limits: ImportLimits) {
    this.root = root;
    this.limits = limits;
  }

  async write(h: Headers, body: Readable): Promise<void> {
    if (++this.entries > this.limits.layerEntries) throw overLimit("a layer's entry count", this.limits, "layerEntries");
    if (h.name.length > PATH_MAX) throw importError(`a layer entry's name is longer than ${PATH_MAX} bytes`);
    const rel = entryPath(h.name);
    if (!rel) return; // the root itself: the layer directory keeps Kiln's root ownership and mode
    const top = rel.split("/")[0];
    if (MACHINE_PROVIDED.has(top) && rel !== top) return;
    const slash = rel.lastIndexOf("/");
    const parent = slash >= 0 ? rel.slice(0, slash) : "";
    const base = rel.slice(slash + 1);
    if (Buffer.byteLength(base) > NAME_MAX) throw importError(`layer entry ${JSON.stringify(h.name.slice(0, 200))} has a name longer than ${NAME_MAX} bytes`);
    const attrs = { uid: shift(h.uid), gid: shift(h.gid), mode: (h.mode ?? 0o644) & 0o7777, mtime: h.mtime ?? new Date(0) };

    try {
      await this.root.ensureDir(parent);
      if (base === OPAQUE) {
        this.opaque.add(parent);
        return;
      }
      if (base.startsWith(WHITEOUT)) {
        const name = base.slice(WHITEOUT.length);
        if (!name || name === "." || name === "..") throw importError(`layer entry ${JSON.stringify(h.name)} is a whiteout without a name`);
        this.whiteouts.add(parent ? `${parent}/${name}` : name);
        return;
      }
      switch (h.type) {
        case "directory":
          await this.root.mkdir(rel, attrs);
          this.dirTimes.set(rel, attrs.mtime);
          break;
        case "file":
        case "contiguous-file": {
          if ((h.size ?? 0) > this.limits.entryBytes) throw overLimit(`layer entry /${rel}`, this.limits, "entryBytes");
          const ino = xattrsToKeep(h.pax as Record<string, string> | undefined).length > 0;
          const size = h.size ?? 0;
          const inode = size <= SMALL_FILE ? await this.root.writeSmallFile(rel, await readSmall(body as AsyncIterable<Buffer>, size), attrs, ino) : await this.root.writeFile(rel, body as AsyncIterable<Buffer>, attrs, ino);
          this.keepXattrs(rel, h, inode);
          this.files++;
          return;
        }
        case "symlink":
          await this.root.symlink(rel, h.linkname ?? "", attrs);
          return;
        case "link": {
          const target = entryPath(h.linkname ?? "");
          if (!target || !(await this.root.link(rel, target))) {
            throw importError(`layer entry ${JSON.stringify(h.name)} is a hard link to ${JSON.stringify(h.linkname)}, which is not a file in the same layer`);
          }
          return;
        }
        case "character-device":
        case "block-device":
        case "fifo":
          throw importError(`layer entry /${rel} is a ${h.type.replace("-", " ")}: OCI special files are not supported in imported images`);
        default:
          throw importError(`layer entry /${rel} has an unsupported type (${h.type})`);
      }
      this.keepXattrs(rel, h);
    } catch (err) {
      if (err instanceof BlockedPath) throw importError(`layer entry /${rel} lies under /${err.at}, which this layer made a ${err.kind}`);
      // A file system's refusal names the entry; a stream's failure (truncated, corrupt) is phrased by unpackLayer.
      if ((err as NodeJS.ErrnoException).syscall) throw importError(`layer entry /${rel} could not be written (${(err as NodeJS.ErrnoException).code})`);
      throw err;
    }
  }

  /** Whiteouts, opaque markers, extended attributes, then directory times (deepest first). */
  async finish(): Promise<void> {
    const mknod: string[] = [];
    for (const rel of this.whiteouts) {
      await this.root.trim(); // walks cache directory handles: keep them few, however many paths there are
      const kind = await this.root.kind(rel).catch(() => "blocked" as const);
      // Whiteouts hide what lower layers have. A path this layer itself fills already hides them, so it stays;
      // a directory made here as well becomes opaque (the lower one is gone, this one is new).
      if (kind === undefined) mknod.push(rel);
      else if (kind === "dir") this.opaque.add(rel);
    }
    await this.root.mknodWhiteouts(mknod);
    const xattrs = [...this.xattrs].map(([rel, x]) => ({ rel, ...x }));
    for (const rel of this.opaque) {
      await this.root.trim();
      if ((await this.root.kind(rel).catch(() => undefined)) === "dir") xattrs.push({ rel, attrs: [{ name: "trusted.overlay.opaque", value: Buffer.from("y") }] });
    }
    await this.root.setXattrs(xattrs);
    const dirs = [...this.dirTimes].sort(([a], [b]) => depth(b) - depth(a));
    for (const [rel, mtime] of dirs) {
      await this.root.trim();
      await this.root.setDirTime(rel, mtime);
    }
  }

  /** The extended attributes of an entry's PAX records Kiln keeps (see xattrsToKeep), set after the whole layer. */
  private keepXattrs(rel: string, h: Headers, ino?: number): void {
    this.xattrs.delete(rel);
    const attrs = xattrsToKeep(h.pax as Record<string, string> | undefined);
    if (attrs.length) this.xattrs.set(rel, { ino, attrs });
  }
}

/**
 * `user.*` attributes are kept as they are. `security.capability` is kept rewritten as a v3 (namespaced) capability
 * whose root is the machines' root (host uid 100000): it works inside a machine and is inert on the host, where a v2
 * capability on a layer file would grant its capabilities to any host user able to run that file. Everything else is
 * dropped: `trusted.*` is overlayfs's own namespace (a layer could forge an opaque dir or a redirect), other
 * `security.*` attributes are host labels (SELinux, IMA/EVM) and `system.*` carries ACLs naming unshifted ids.
 * tar-stream decodes PAX values as UTF-8, so a value that does not survive that (U+FFFD) is skipped.
 */
export function xattrsToKeep(pax: Record<string, string> | undefined): { name: string; value: Buffer }[] {
  const out: { name: string; value: Buffer }[] = [];
  for (const [key, value] of Object.entries(pax ?? {})) {
    if (!key.startsWith("SCHILY.xattr.") || typeof value !== "string" || value.includes("\uFFFD")) continue;
    const name = key.slice("SCHILY.xattr.".length);
    if (/^user\.[A-Za-z0-9._@:+-]{1,200}$/.test(name)) out.push({ name, value: Buffer.from(value, "utf8") });
    else if (name === "security.capability") {
      const cap = namespacedCapability(Buffer.from(value, "utf8"));
      if (cap) out.push({ name, value: cap });
    }
  }
  return out;
}

/** A v2 (or v3 with root 0) file capability as v3 rooted at the machines' root; anything else undefined. */
export function namespacedCapability(v: Buffer): Buffer | undefined {
  const magic = v.length >= 4 ? v.readUInt32LE(0) : 0;
  const revision = magic & 0xff000000;
  const ok = (revision === 0x02000000 && v.length === 20) || (revision === 0x03000000 && v.length === 24 && v.readUInt32LE(20) === 0);
  if (!ok || (magic & 0x00fffffe) !== 0) return undefined;
  const out = Buffer.alloc(24);
  out.writeUInt32LE(0x03000000 | (magic & 1), 0);
  v.copy(out, 4, 4, 20);
  out.writeUInt32LE(HOST_ID_BASE, 20);
  return out;
}

/** `a/./b/` → `a/b`; anything that climbs above the root is refused. */
export function entryPath(name: string): string {
  const parts: string[] = [];
  for (const p of name.split("/")) {
    if (!p || p === ".") continue;
    if (p === "..") {
      if (!parts.length) throw importError(`layer entry ${JSON.stringify(name.slice(0, 200))} escapes the image root`);
      parts.pop();
    } else if (p.includes("\0")) {
      throw importError(`layer entry ${JSON.stringify(name.slice(0, 200))} has a NUL byte in its name`);
    } else parts.push(p);
  }
  return parts.join("/");
}

/** A small entry's body, all `size` bytes of it (the tar header says how many; never more are kept). */
async function readSmall(body: AsyncIterable<Buffer>, size: number): Promise<Buffer> {
  const chunks: Buffer[] = [];
  let n = 0;
  for await (const chunk of body) {
    n += chunk.length;
    if (n > size) throw importError(`a layer entry is longer than the ${size} bytes its header declares`);
    chunks.push(chunk);
  }
  return chunks.length === 1 ? chunks[0] : Buffer.concat(chunks, n);
}

function shift(id: number | undefined): number {
  const n = id ?? 0;
  return HOST_ID_BASE + (n >= 0 && n < ID_RANGE ? n : NOBODY);
}

function depth(rel: string): number {
  let n = 0;
  for (const c of rel) if (c === "/") n++;
  return n;
}

/** Any failure as the build_error it becomes; a stream's own error (truncated, corrupt) says what it was. */
function asImportError(err: Error, streamError?: unknown): Error {
  if ((err as { detail?: unknown }).detail) return err;
  const stream = streamError as (Error & { detail?: unknown }) | undefined;
  if (stream?.detail) return stream;
  const why = stream?.message ?? err.message;
  return importError(`a layer could not be unpacked: ${why.replace(/\/proc\/(self|\d+)\/fd\/\d+\/?/g, "")}`);
}
