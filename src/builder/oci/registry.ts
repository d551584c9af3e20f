// The OCI distribution client (pull side) over undici: manifests with the right Accept, blobs streamed to disk
// with their sha256 checked on the way and resumed with Range after a cut, and registry auth answered per repo.

import { createHash } from "node:crypto";
import { constants } from "node:fs";
import { mkdir, open, rename, rm, stat, truncate } from "node:fs/promises";
import { dirname } from "node:path";
import { Agent, request } from "undici";
import type { Dispatcher } from "undici";
import { basicHeader, credentialFor, parseChallenge } from "./auth.ts";
import type { BaseImageAuth, RegistryCredential } from "./auth.ts";
import { sameRegistry } from "./reference.ts";
import { DEFAULT_IMPORT_LIMITS, overLimit } from "./limits.ts";
import type { ImportLimits } from "./limits.ts";
import { MANIFEST_ACCEPT, checkDigest, importError } from "./types.ts";
import { guardedConnector } from "../../net/guarded-connect.ts";

export interface RegistryClientOptions {
  auth?: BaseImageAuth;
  /** Hosts (host or host:port) reached over plain HTTP: KILN_INSECURE_REGISTRIES. */
  insecureRegistries?: string[];
  /** Bound on one request's headers and on silence while a body streams. */
  timeoutMs?: number;
  /** Cancels every request in flight (a cancelled build). */
  signal?: AbortSignal;
  limits?: ImportLimits;
}

export interface Manifest {
  digest: string;
  mediaType: string;
  body: Buffer;
  json: Record<string, unknown>;
}

const BLOB_ATTEMPTS = 5;
/** What the partial file is written in: one positional write per this many bytes received. */
const TEE_BATCH = 1 << 20;
/** A token service's answer: a JSON object with a token in it. */
const MAX_TOKEN_BYTES = 1 << 20;

/** One client per import: it keeps the bearer tokens it was given for each repository. */
export function createRegistryClient(registry: string, opts: RegistryClientOptions = {}) {
  const insecure = (opts.insecureRegistries ?? []).some((h) => sameRegistry(h, registry));
  const origin = `${insecure ? "http" : "https"}://${registry}`;
  const credential: RegistryCredential = credentialFor(opts.auth, registry);
  const timeout = opts.timeoutMs ?? 60_000;
  // Every connection (the registry, its token realm, a redirect's target) is judged at connect time: loopback and
  // private addresses only for hosts KILN_INSECURE_REGISTRIES lists, link-local and metadata addresses never.
  const listed = (opts.insecureRegistries ?? []).map((h) => h.replace(/^https?:\/\//, "").replace(/\/.*$/, "").toLowerCase());
  const connect = guardedConnector({
    timeout: Math.min(timeout, 15_000),
    allowPrivate: (hostname, port) => {
      const host = (hostname.includes(":") ? `[${hostname}]` : hostname).toLowerCase();
      return listed.includes(host) || listed.includes(`${host}:${port}`);
    },
    refused: (message) => importError(`Kiln does not connect to ${message}${/private or loopback/.test(message) ? "; a registry there must be listed in KILN_INSECURE_REGISTRIES" : ""}`),
  });
  const dispatcher = new Agent({ headersTimeout: timeout, bodyTimeout: timeout, connect });
  const tokens = new Map<string, string>();
  const limits = opts.limits ?? DEFAULT_IMPORT_LIMITS;

  function authorization(repository: string): string | undefined {
    const token = tokens.get(repository);
    if (token) return token;
    if (credential?.kind === "bearer") return `Bearer ${credential.token}`;
    return undefined;
  }

  /** Answers a 401's challenge once: a token from the realm (Bearer) or the basic credential itself. */
  async function authenticate(repository: string, header: string | undefined): Promise<void> {
    const challenge = parseChallenge(header);
    if (challenge?.scheme === "basic") {
      if (credential?.kind !== "basic") throw importError(`registry ${registry} requires a username and password (base_image_auth)`);
      tokens.set(repository, basicHeader(credential.username, credential.password));
      return;
    }
    if (challenge?.scheme !== "bearer" || !challenge.params.realm) throw importError(`registry ${registry} refused access to ${repository} and offered no usable authentication`);
    if (credential?.kind === "bearer" && !tokens.has(repository)) {
      // A `token` credential is a registry token already: it is tried as-is before anything else.
      tokens.set(repository, `Bearer ${credential.token}`);
      return;
    }
    let realm: URL;
    try {
      realm = new URL(challenge.params.realm);
    } catch {
      throw importError(`registry ${registry} named a token realm that is not a URL`);
    }
    if (challenge.params.service) realm.searchParams.set("service", challenge.params.service);
    realm.searchParams.set("scope", `repository:${repository}:pull`);
    const headers: Record<string, string> = {};
    if (credential?.kind === "basic") headers.authorization = basicHeader(credential.username, credential.password);
    const res = await send(realm, headers);
    const text = (await readCapped(res, MAX_TOKEN_BYTES, () => importError(`registry ${registry}'s token service answered more than ${MAX_TOKEN_BYTES} bytes`))).toString();
    if (res.statusCode === 401 || res.statusCode === 403) throw importError(`registry ${registry} refused the credentials for ${repository} (${res.statusCode})`);
    if (res.statusCode !== 200) throw importError(`registry ${registry}'s token service answered ${res.statusCode}`);
    let body: { token?: string; access_token?: string };
    try {
      body = JSON.parse(text);
    } catch {
      throw importError(`registry ${registry}'s token service answered something that is not JSON`);
    }
    const token = body.token ?? body.access_token;
    if (!token) throw importError(`registry ${registry}'s token service gave no token`);
    tokens.set(repository, `Bearer ${token}`);
  }

  /**
   * A GET on the registry with auth handled: one retry after a 401 (with the challenge answered), redirects
   * followed by hand so that Authorization never goes to another origin (blob storage behind a redirect).
   */
  async function get(repository: string, path: string, headers: Record<string, string> = {}, signal = opts.signal): Promise<Dispatcher.ResponseData> {
    for (let attempt = 0; ; attempt++) {
      const auth = authorization(repository);
      let url = new URL(`${origin}/v2/${repository}/${path}`);
      let res = await send(url, { ...headers, ...(auth ? { authorization: auth } : {}) }, signal);
      for (let hops = 0; res.statusCode >= 300 && res.statusCode < 400 && res.headers.location; hops++) {
        if (hops >= 5) throw importError(`registry ${registry} redirected ${path} too many times`);
        await res.body.dump();
        url = new URL(String(res.headers.location), url);
        const sameOrigin = url.origin === origin;
        res = await send(url, { ...headers, ...(auth && sameOrigin ? { authorization: auth } : {}) }, signal);
      }
      if (res.statusCode === 401 && attempt === 0) {
        await res.body.dump();
        await authenticate(repository, header(res.headers["www-authenticate"]));
        continue;
      }
      if (res.statusCode === 401 || res.statusCode === 403) {
        await res.body.dump();
        throw importError(`registry ${registry} refused access to ${repository} (${res.statusCode})${credential ? "" : ": it may need base_image_auth"}`);
      }
      return res;
    }
  }

  async function send(url: URL, headers: Record<string, string>, signal = opts.signal): Promise<Dispatcher.ResponseData> {
    try {
      const res = await request(url, { headers, dispatcher, signal });
      // A body that errors (a reset connection, a cancel) while nobody reads it must not be an unhandled 'error'
      // event, which would end the process; whoever reads it still sees the error.
      res.body.on("error", () => {});
      return res;
    } catch (err) {
      if (signal?.aborted || (err as { detail?: unknown }).detail) throw err; // a cancel, or an address refused
      throw importError(`registry ${registry} could not be reached: ${(err as Error).message}`);
    }
  }

  async function getManifest(repository: string, reference: string): Promise<Manifest> {
    if (reference.includes(":")) checkDigest(reference, `a manifest of ${repository}`);
    const res = await get(repository, `manifests/${reference}`, { accept: MANIFEST_ACCEPT });
    if (res.statusCode === 404) {
      await res.body.dump();
      throw importError(`image ${registry}/${repository}:${reference} was not found`);
    }
    if (res.statusCode !== 200) {
      await res.body.dump();
      throw importError(`registry ${registry} answered ${res.statusCode} for the manifest of ${repository}:${reference}`);
    }
    const body = await readCapped(res, limits.manifestBytes, () => overLimit(`the manifest of ${repository}:${reference}`, limits, "manifestBytes"));
    const digest = `sha256:${createHash("sha256").update(body).digest("hex")}`;
    if (reference.startsWith("sha256:") && digest !== reference) throw importError(`the manifest of ${repository}@${reference} does not match its digest (got ${digest})`);
    let json: Record<string, unknown>;
    try {
      json = JSON.parse(body.toString());
    } catch {
      throw importError(`the manifest of ${repository}:${reference} is not JSON`);
    }
    const mediaType = (typeof json.mediaType === "string" && json.mediaType) || String(header(res.headers["content-type"]) ?? "").split(";")[0];
    return { digest, mediaType, body, json };
  }

  /**
   * A blob's bytes as they arrive, for a caller that unpacks while it downloads. Its sha256 is computed on the way
   * and checked after the last byte: a mismatch (or a byte past `size`, the size its descriptor declares) is thrown
   * by the iterator after everything before it was yielded, so what the caller made of those bytes is unverified
   * until the iteration ends normally. A cut connection is resumed with Range from the bytes already yielded (a
   * server that ignores Range has them skipped, not yielded twice: the digest covers exactly what was yielded).
   * Every byte is also written to `partial`, and a `partial` left by an earlier import is replayed first, so an
   * import killed half-way resumes where it stopped. The partial is kept only when the connection could not be
   * resumed or the import was cancelled; any other end (the consumer's failure, a mismatch, an oversize) deletes
   * it, so a partial that is wrong fails one import at most. A verified blob's partial is deleted too, unless
   * `keep` names where the whole blob is kept.
   */
  async function* blobBytes(repository: string, digest: string, size: number, partial: string, how: { onBytes?: (n: number) => void; keep?: string; signal?: AbortSignal } = {}): AsyncGenerator<Buffer, void, undefined> {
    checkDigest(digest, `a blob of ${repository}`);
    // The caller's signal stops this blob's requests at once (a sibling layer failed), not at its next byte.
    const signal = how.signal && opts.signal ? AbortSignal.any([opts.signal, how.signal]) : (how.signal ?? opts.signal);
    await mkdir(dirname(partial), { recursive: true });
    const hash = createHash("sha256");
    let offset = 0;
    let resumable = false;
    const have = await stat(partial).catch(() => undefined);
    if (have && have.size > size) await truncate(partial, 0);
    // A file handle, not a write stream: a full disk is a rejection here, never an unhandled 'error' event. It is
    // open before the request, so the body is written the moment it arrives: a connection cut early still leaves
    // what came on disk, for a later import to resume from. Writes are positional, one batch in flight.
    const out = await open(partial, constants.O_RDWR | constants.O_CREAT, 0o600);
    let batch: Buffer[] = [];
    let batchBytes = 0;
    let written = 0;
    let writing: Promise<unknown> = Promise.resolve();
    const flush = async () => {
      await writing;
      if (!batchBytes) return;
      const bufs = batch;
      const at = written;
      written += batchBytes;
      batch = [];
      batchBytes = 0;
      writing = out.writev(bufs, at).catch((err: NodeJS.ErrnoException) => {
        throw importError(`blob ${digest} could not be written to the importer's cache (${err.code ?? err.message})`);
      });
      writing.catch(() => {}); // awaited by the next flush; never an unhandled rejection meanwhile
    };
    /** Yields a chunk downstream; an error thrown into the generator there is the consumer's, never retried. */
    let downstream = false;
    const deliver = async function* (chunk: Buffer, tee: boolean) {
      hash.update(chunk);
      offset += chunk.length;
      if (tee) {
        batch.push(chunk);
        batchBytes += chunk.length;
        if (batchBytes >= TEE_BATCH) await flush();
      }
      try {
        yield chunk;
      } catch (err) {
        downstream = true;
        throw err;
      }
    };
    try {
      if (have && have.size > 0 && have.size <= size) {
        for await (const chunk of out.createReadStream({ start: 0, end: have.size - 1, highWaterMark: TEE_BATCH, autoClose: false })) yield* deliver(chunk as Buffer, false);
        written = offset;
      }
      let lastError: unknown;
      let attempt = 0;
      for (; attempt < BLOB_ATTEMPTS; attempt++) {
        try {
          const res = await get(repository, `blobs/${digest}`, offset > 0 ? { range: `bytes=${offset}-` } : {}, signal);
          if (res.statusCode === 416 && offset > 0) {
            await res.body.dump(); // everything is here already
          } else if (res.statusCode === 200 || res.statusCode === 206) {
            // A server that ignored Range sends the blob from its start: what was already yielded is skipped.
            let skip = res.statusCode === 200 ? offset : 0;
            for await (const body of res.body as AsyncIterable<Buffer>) {
              let chunk = body;
              if (skip > 0) {
                const n = Math.min(skip, chunk.length);
                skip -= n;
                chunk = chunk.subarray(n);
                if (!chunk.length) continue;
              }
              if (offset + chunk.length > size) {
                res.body.destroy();
                throw importError(`blob ${digest} of ${registry}/${repository} is larger than the ${size} bytes its descriptor declares`);
              }
              how.onBytes?.(chunk.length);
              yield* deliver(chunk, true);
            }
          } else {
            await res.body.dump();
            if (res.statusCode === 404) throw importError(`blob ${digest} of ${registry}/${repository} was not found`);
            throw importError(`registry ${registry} answered ${res.statusCode} for blob ${digest}`);
          }
        } catch (err) {
          // A verdict, the consumer's own failure or a cancel ends it; a cut connection is resumed.
          if (downstream || (err as { detail?: unknown }).detail || signal?.aborted) throw err;
          lastError = err;
          continue;
        }
        break;
      }
      if (attempt === BLOB_ATTEMPTS) {
        resumable = true;
        throw importError(`blob ${digest} of ${registry}/${repository} could not be downloaded after ${BLOB_ATTEMPTS} attempts: ${(lastError as Error)?.message}`);
      }
      await flush();
      await writing;
      const got = `sha256:${hash.digest("hex")}`;
      if (got !== digest) throw importError(`blob ${digest} of ${registry}/${repository} does not match its digest (got ${got})`);
      await out.close();
      if (how.keep) await rename(partial, how.keep);
      else await rm(partial, { force: true });
    } finally {
      await flush().catch(() => {});
      await writing.catch(() => {});
      await out.close().catch(() => {});
      if (!resumable && !signal?.aborted) await rm(partial, { force: true });
    }
  }

  /** Downloads a whole blob into `dest` (see blobBytes: checked, bounded, resumed); its size. */
  async function downloadBlob(repository: string, digest: string, size: number, dest: string, onBytes?: (n: number) => void): Promise<number> {
    let n = 0;
    for await (const chunk of blobBytes(repository, digest, size, `${dest}.partial`, { onBytes, keep: dest })) n += chunk.length;
    return n;
  }

  return { registry, getManifest, downloadBlob, blobBytes, close: () => dispatcher.close() };
}

export type RegistryClient = ReturnType<typeof createRegistryClient>;

/** The whole body, refused (and the connection dropped) as soon as it passes `max` bytes. */
async function readCapped(res: Dispatcher.ResponseData, max: number, tooLarge: () => Error): Promise<Buffer> {
  const declared = Number(header(res.headers["content-length"]));
  if (declared > max) {
    res.body.destroy();
    throw tooLarge();
  }
  const chunks: Buffer[] = [];
  let n = 0;
  for await (const chunk of res.body) {
    n += chunk.length;
    if (n > max) {
      res.body.destroy();
      throw tooLarge();
    }
    chunks.push(chunk);
  }
  return Buffer.concat(chunks);
}

function header(v: string | string[] | undefined): string | undefined {
  return Array.isArray(v) ? v[0] : v;
}
