// The build context's content-addressed blob store under $KILN_DATA_DIR/blobs: uploads verified against their
// sha256 while streaming to disk (a mismatch stores nothing), and a build's context files checked before it starts.

import { createHash } from "node:crypto";
import { createReadStream, createWriteStream, existsSync } from "node:fs";
import { mkdir, readdir, rename, rm, stat, utimes } from "node:fs/promises";
import { join } from "node:path";
import type { Readable } from "node:stream";
import { pipeline } from "node:stream/promises";
import { Transform } from "node:stream";
import { KilnError } from "../errors.ts";

export interface ContextFile {
  path: string;
  sha256: string;
  mode?: string;
  /** Where the blob's bytes are on the host. */
  blobPath: string;
}

export const SHA256_HEX = "^[0-9a-f]{64}$";
const HEX = new RegExp(SHA256_HEX);

export function createBlobStore(dataDir: string) {
  const dir = join(dataDir, "blobs");
  const pathOf = (sha: string) => {
    if (!HEX.test(sha)) throw new KilnError("invalid_request", "A blob is named by the lowercase hex sha256 of its bytes");
    return join(dir, sha);
  };

  /** Whether the blob is stored (a client asks before a build that names it: that counts as a use). */
  async function has(sha: string): Promise<{ size: number } | null> {
    const st = await stat(pathOf(sha)).catch(() => null);
    if (st) await used(pathOf(sha));
    return st ? { size: st.size } : null;
  }

  /** A blob's mtime is its last use: retention (collect) removes what nothing used for the retention period. */
  async function used(path: string): Promise<void> {
    const now = new Date();
    await utimes(path, now, now).catch(() => undefined);
  }

  /** Streams `body` to disk, hashing as it goes; only bytes whose digest is `sha` are kept. */
  async function put(sha: string, body: Readable, maxBytes: number): Promise<{ size: number; created: boolean }> {
    const final = pathOf(sha);
    await mkdir(dir, { recursive: true });
    const tmp = join(dir, `.upload-${sha}-${process.pid}-${Math.random().toString(36).slice(2)}`);
    const hash = createHash("sha256");
    let size = 0;
    const counter = new Transform({
      transform(chunk: Buffer, _enc, cb) {
        size += chunk.length;
        if (size > maxBytes) return cb(new KilnError("payload_too_large", `A context blob may hold at most ${maxBytes} bytes (KILN_BODY_LIMIT_BYTES)`));
        hash.update(chunk);
        cb(null, chunk);
      },
    });
    try {
      await pipeline(body, counter, createWriteStream(tmp, { mode: 0o600 }));
      const actual = hash.digest("hex");
      if (actual !== sha) throw new KilnError("invalid_request", `The uploaded bytes have sha256 ${actual}, not ${sha}; nothing was stored`);
      const created = !existsSync(final);
      await rename(tmp, final);
      return { size, created };
    } finally {
      await rm(tmp, { force: true });
    }
  }

  /** Re-hashes a stored blob: a blob whose bytes changed on disk is as good as missing. */
  async function verify(sha: string): Promise<"ok" | "missing" | "corrupt"> {
    const p = pathOf(sha);
    if (!existsSync(p)) return "missing";
    await used(p);
    const hash = createHash("sha256");
    await pipeline(createReadStream(p), async function* (src) {
      for await (const chunk of src) hash.update(chunk as Buffer);
    });
    return hash.digest("hex") === sha ? "ok" : "corrupt";
  }

  /**
   * Removes blobs unused since `staleBefore` (and since the oldest running build was queued: such a build touched
   * what it uses while it prepared), and upload leftovers an hour old. Returns how many went.
   */
  async function collect(opts: { staleBefore: number; runningSince?: number }): Promise<number> {
    const cutoff = Math.min(opts.staleBefore, opts.runningSince ?? Infinity);
    let removed = 0;
    for (const name of await readdir(dir).catch(() => [] as string[])) {
      const path = join(dir, name);
      const st = await stat(path).catch(() => null);
      if (!st?.isFile()) continue;
      const leftover = name.startsWith(".");
      if (leftover ? Date.now() - st.mtimeMs < 3600_000 : st.mtimeMs >= cutoff) continue;
      if (!leftover && !HEX.test(name)) continue; // not ours
      await rm(path, { force: true });
      removed++;
    }
    return removed;
  }

  return { dir, has, put, verify, pathOf, collect };
}

export type BlobStore = ReturnType<typeof createBlobStore>;

/** Context files `copy src` selects: the file itself, everything under a directory, or all of them for "." or "/". */
export function selectContext(files: ContextFile[], src: string): { file: ContextFile; rel: string }[] {
  const norm = src.replace(/^\.\/+/, "").replace(/\/+$/, "");
  if (norm === "" || norm === "." || src === "/") return files.map((file) => ({ file, rel: file.path }));
  const exact = files.find((f) => f.path === norm);
  if (exact) return [{ file: exact, rel: "" }];
  return files.filter((f) => f.path.startsWith(norm + "/")).map((file) => ({ file, rel: file.path.slice(norm.length + 1) }));
}
