// Moving an unmounted volume to another host: the source host hashes its image, streams it to the target's
// cluster-only content route, which writes it sparse into a private temporary file, checks size and sha256 and only
// then renames it into place; the source then switches the record's host in one conditional update and removes its
// own copy. A kill -9 anywhere leaves the record naming one host that holds a whole image; the copy the other host
// may keep names a volume it does not own, and its next start (or the next move to it) removes it.

import { createHash, randomBytes } from "node:crypto";
import { createReadStream } from "node:fs";
import { mkdir, open, rename, rm } from "node:fs/promises";
import { join } from "node:path";
import type { Readable } from "node:stream";
import { Agent, request } from "undici";
import { KilnError } from "../errors.ts";
import type { ClusterAuth } from "../hosts/cluster-auth.ts";
import type { VolumePaths } from "./storage.ts";

/** Chunks of the image that are all zeros are not written: the copy stays as sparse as the original. */
const ZERO = Buffer.alloc(64 * 1024);
/** A peer must start answering within this, and not stall longer than this between chunks. */
const STALL_MS = 60_000;
export const INCOMING_PREFIX = ".incoming-";

export async function imageDigest(image: string): Promise<string> {
  const h = createHash("sha256");
  for await (const chunk of createReadStream(image, { highWaterMark: 1024 * 1024 })) h.update(chunk as Buffer);
  return `sha256:${h.digest("hex")}`;
}

const agent = new Agent({ headersTimeout: STALL_MS * 10, bodyTimeout: STALL_MS, connect: { timeout: 5_000 } });

/** Streams the image to `target`; resolves once the target holds it, checked. */
export async function sendImage(auth: ClusterAuth, target: { id: string; url: string }, volumeId: string, image: string, bytes: number, digest: string): Promise<void> {
  const path = `/v1/cluster/volumes/${volumeId}/image?digest=${encodeURIComponent(digest)}&bytes=${bytes}`;
  let res;
  try {
    res = await request(target.url + path, {
      method: "PUT",
      headers: { "content-type": "application/octet-stream", "content-length": String(bytes), ...auth.sign("PUT", path, target.id, undefined) },
      body: createReadStream(image, { highWaterMark: 1024 * 1024 }),
      dispatcher: agent,
    });
  } catch (err) {
    throw new KilnError("unavailable", `Host ${target.id} could not be reached to receive the volume: ${(err as Error).message.slice(0, 200)}`, { detail: { retryable: true } });
  }
  const text = await res.body.text().catch(() => "");
  if (res.statusCode !== 204) {
    let why = text.slice(0, 300);
    try {
      why = (JSON.parse(text) as { error?: string }).error ?? why;
    } catch {
      // not an envelope
    }
    throw new KilnError(res.statusCode === 503 ? "unavailable" : "conflict", `Host ${target.id} did not take the volume: ${why}`);
  }
}

/**
 * Writes an incoming image into `paths.image`: through a private temporary file in the volumes dir, zero chunks
 * skipped (sparse), exactly `bytes` long and hashing to `digest`, else nothing of it stays.
 */
export async function receiveImage(body: Readable, paths: VolumePaths, volumesDir: string, bytes: number, digest: string): Promise<void> {
  await mkdir(volumesDir, { recursive: true, mode: 0o711 });
  const tmp = join(volumesDir, `${INCOMING_PREFIX}${randomBytes(6).toString("hex")}`);
  const fh = await open(tmp, "wx", 0o600);
  const h = createHash("sha256");
  let at = 0;
  try {
    for await (const c of body) {
      const chunk = c as Buffer;
      if (at + chunk.length > bytes) throw new KilnError("invalid_request", `The image is longer than its announced ${bytes} bytes`);
      h.update(chunk);
      if (!isZero(chunk)) await fh.write(chunk, 0, chunk.length, at);
      at += chunk.length;
    }
    if (at !== bytes) throw new KilnError("invalid_request", `The image ended at ${at} of its ${bytes} bytes`);
    const got = `sha256:${h.digest("hex")}`;
    if (got !== digest) throw new KilnError("conflict", `The image's content (${got}) does not match its digest ${digest}`);
    await fh.truncate(bytes);
    await fh.sync();
    await fh.close();
    await mkdir(paths.dir, { recursive: true });
    await rename(tmp, paths.image);
  } catch (err) {
    await fh.close().catch(() => undefined);
    await rm(tmp, { force: true });
    throw err;
  }
}

function isZero(chunk: Buffer): boolean {
  for (let i = 0; i < chunk.length; i += ZERO.length) {
    const n = Math.min(ZERO.length, chunk.length - i);
    if (!chunk.subarray(i, i + n).equals(ZERO.subarray(0, n))) return false;
  }
  return true;
}
