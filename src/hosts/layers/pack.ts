// A layer directory as the tar peers fetch: OCI form (ownership back in the machine's own ids, overlayfs whiteouts as
// `.wh.` entries, opaque directories as `.wh..wh..opq`), entries in name order, times in whole seconds. The same
// directory always packs to the same bytes, and a directory the importer unpacked from that tar (src/builder/oci/
// unpack.ts) packs to them again: the tar's sha256 is the layer's content digest, checked by whoever fetches it.

import { createHash } from "node:crypto";
import { createReadStream } from "node:fs";
import { lstat, readdir, readlink } from "node:fs/promises";
import type { Stats } from "node:fs";
import { join } from "node:path";
import { Writable } from "node:stream";
import type { Readable } from "node:stream";
import { pipeline } from "node:stream/promises";
import { getAttribute, listAttributes } from "@napi-rs/xattr";
import { pack } from "tar-stream";
import type { Header as Headers, Pack } from "tar-stream";
import { HOST_ID_BASE, ID_RANGE } from "../../runtime/oci/idmap.ts";

/** Top-level directories a machine mounts at boot: their contents are not part of a layer a peer fetches. */
const MACHINE_PROVIDED = new Set(["dev", "proc", "sys"]);
const NOBODY = 65_534;

/** The packed tar of `dir`, streamed as it is read (back-pressured: one file's bytes at a time). */
export function packLayer(dir: string, signal?: AbortSignal): Readable {
  const out = pack();
  walk(dir, out, signal).then(
    () => out.finalize(),
    (err: Error) => out.destroy(err),
  );
  return out as unknown as Readable;
}

/** The layer's content digest (`sha256:<hex>`, the sha256 of its packed tar) and that tar's size in bytes. */
export async function layerDigest(dir: string, signal?: AbortSignal): Promise<{ digest: string; bytes: number }> {
  const hash = createHash("sha256");
  let bytes = 0;
  await pipeline(
    packLayer(dir, signal),
    new Writable({
      write(chunk: Buffer, _enc, cb) {
        hash.update(chunk);
        bytes += chunk.length;
        cb();
      },
    }),
    { signal },
  );
  return { digest: `sha256:${hash.digest("hex")}`, bytes };
}

async function walk(root: string, out: Pack, signal?: AbortSignal): Promise<void> {
  /** Inode → the name its first link was packed under: later links become hard-link entries. */
  const links = new Map<string, string>();
  const visit = async (rel: string): Promise<void> => {
    const names = (await readdir(join(root, rel))).sort();
    for (const name of names) {
      signal?.throwIfAborted();
      const path = join(root, rel, name);
      const entry = rel ? `${rel}/${name}` : name;
      const st = await lstat(path);
      if (st.isCharacterDevice() && st.rdev === 0) {
        await add(out, { ...base(`${rel ? `${rel}/` : ""}.wh.${name}`, st), mode: 0o644, uid: 0, gid: 0, mtime: new Date(0) });
        continue;
      }
      if (st.isDirectory()) {
        await add(out, { ...base(`${entry}/`, st), type: "directory", pax: await userXattrs(path) });
        if (await isOpaque(path)) await add(out, { ...base(`${entry}/.wh..wh..opq`, st), mode: 0o644, uid: 0, gid: 0, mtime: new Date(0) });
        if (rel === "" && MACHINE_PROVIDED.has(name)) continue;
        await visit(entry);
        continue;
      }
      if (st.isSymbolicLink()) {
        await add(out, { ...base(entry, st), type: "symlink", linkname: await readlink(path), mode: 0o777, mtime: new Date(0) });
        continue;
      }
      if (st.isFile()) {
        const ino = `${st.dev}:${st.ino}`;
        const first = st.nlink > 1 ? links.get(ino) : undefined;
        if (first !== undefined) {
          await add(out, { ...base(entry, st), type: "link", linkname: first });
          continue;
        }
        if (st.nlink > 1) links.set(ino, entry);
        await addFile(out, { ...base(entry, st), type: "file", size: st.size, pax: await userXattrs(path) }, path);
        continue;
      }
      // A fifo or device a build left: packed as what it is; the importer refuses it with a message naming it.
      await add(out, { ...base(entry, st), type: st.isFIFO() ? "fifo" : st.isBlockDevice() ? "block-device" : "character-device" });
    }
  };
  await visit("");
}

function base(name: string, st: Stats): Partial<Headers> & { name: string } {
  return { name, mode: st.mode & 0o7777, uid: unshift(st.uid), gid: unshift(st.gid), mtime: new Date(Math.floor(st.mtimeMs / 1000) * 1000) };
}

function unshift(id: number): number {
  return id >= HOST_ID_BASE && id < HOST_ID_BASE + ID_RANGE ? id - HOST_ID_BASE : NOBODY;
}

/** `user.*` attributes whose values are text (what the importer keeps); overlayfs's `trusted.*` ones are its own. */
async function userXattrs(path: string): Promise<Record<string, string> | undefined> {
  const names = (await listAttributes(path).catch(() => [] as string[])).filter((n) => /^user\.[A-Za-z0-9._@:+-]{1,200}$/.test(n)).sort();
  const out: Record<string, string> = {};
  for (const name of names) {
    const v = await getAttribute(path, name).catch(() => null);
    const text = v ? Buffer.from(v).toString("utf8") : undefined;
    if (text !== undefined && !text.includes("\uFFFD")) out[`SCHILY.xattr.${name}`] = text;
  }
  return Object.keys(out).length ? out : undefined;
}

async function isOpaque(path: string): Promise<boolean> {
  const v = await getAttribute(path, "trusted.overlay.opaque").catch(() => null);
  return v !== null && Buffer.from(v).toString() === "y";
}

function add(out: Pack, header: Partial<Headers> & { name: string }): Promise<void> {
  // A file entry without a body (a whiteout, an opaque marker) is given its empty body, or it would wait for one.
  const empty = header.type === undefined || header.type === "file" ? Buffer.alloc(0) : null;
  return new Promise((resolve, reject) => {
    const done = (err?: Error | null) => (err ? reject(err) : resolve());
    if (empty) out.entry(header, empty, done);
    else out.entry(header, done);
  });
}

async function addFile(out: Pack, header: Partial<Headers> & { name: string }, path: string): Promise<void> {
  let done!: Promise<void>;
  const sink = new Promise<Writable>((resolve) => {
    done = new Promise<void>((ok, fail) => resolve(out.entry(header, (err) => (err ? fail(err) : ok())) as unknown as Writable));
  });
  await pipeline(createReadStream(path, { highWaterMark: 1 << 20 }), await sink);
  await done;
}
