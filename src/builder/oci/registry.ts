// The OCI distribution client (pull side) over undici: manifests with the right Accept, blobs streamed to disk
// with their sha256 checked on the way and resumed with Range after a cut, and registry auth answered per repo.

import { createHash } from "node:crypto";
import { createReadStream } from "node:fs";
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
  async function get(repository: string, path: string, headers: Record<string, string> = {}): Promise<Dispatcher.ResponseData> {
    for (let attempt = 0; ; attempt++) {
      const auth = authorization(repository);
      let url = new URL(`${origin}/v2/${repository}/${path}`);
      let res = await send(url, { ...headers, ...(auth ? { authorization: auth } : {}) });
      for (let hops = 0; res.statusCode >= 300 && res.statusCode < 400 && res.headers.location; hops++) {
        if (hops >= 5) throw importError(`registry ${registry} redirected ${path} too many times`);
        await res.body.dump();
        url = new URL(String(res.headers.location), url);
        const sameOrigin = url.origin === origin;
        res = await send(url, { ...headers, ...(auth && sameOrigin ? { authorization: auth } : {}) });
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

  async function send(url: URL, headers: Record<string, string>): Promise<Dispatcher.ResponseData> {
    try {
      const res = await request(url, { headers, dispatcher, signal: opts.signal });
      // A body that errors (a reset connection, a cancel) while nobody reads it must not be an unhandled 'error'
      // event, which would end the process; whoever reads it still sees the error.
      res.body.on("error", () => {});
      return res;
    } catch (err) {
      if (opts.signal?.aborted || (err as { detail?: unknown }).detail) throw err; // a cancel, or an address refused
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
   * Streams a blob into `dest`, checking its sha256 as it arrives and never past `size`, the size its descriptor
   * declares (a registry that sends more is refused at that byte). A cut connection is resumed with Range from
   * the bytes already on disk (a `.partial` file kept beside `dest`); a mismatch deletes the partial and fails.
   */
  async function downloadBlob(repository: string, digest: string, size: number, dest: string, onBytes?: (n: number) => void): Promise<number> {
    checkDigest(digest, `a blob of ${repository}`);
    const partial = `${dest}.partial`;
    await mkdir(dirname(dest), { recursive: true });
    let hash = createHash("sha256");
    let offset = 0;
    const have = await stat(partial).catch(() => undefined);
    if (have && have.size > size) await truncate(partial, 0);
    else if (have) {
      for await (const chunk of createReadStream(partial)) hash.update(chunk as Buffer);
      offset = have.size;
    }
    let lastError: unknown;
    for (let attempt = 0; attempt < BLOB_ATTEMPTS; attempt++) {
      // A file handle, not a write stream: a full disk is a rejection here, never an unhandled 'error' event. It is
      // open before the request, so the body is read the moment it arrives: a connection cut early still leaves
      // what came on disk, for the next attempt to resume from.
      const out = await open(partial, "a", 0o600);
      try {
        const res = await get(repository, `blobs/${digest}`, offset > 0 ? { range: `bytes=${offset}-` } : {});
        if (res.statusCode === 416 && offset > 0) {
          await res.body.dump(); // everything is here already
        } else if (res.statusCode === 200 || res.statusCode === 206) {
          const restart = res.statusCode === 200 && offset > 0; // the server ignored Range: start over
          if (restart) {
            hash = createHash("sha256");
            offset = 0;
          }
          let first = restart;
          for await (const chunk of res.body) {
            if (first) {
              await out.truncate(0);
              first = false;
            }
            if (offset + chunk.length > size) {
              res.body.destroy();
              await out.truncate(0);
              throw importError(`blob ${digest} of ${registry}/${repository} is larger than the ${size} bytes its descriptor declares`);
            }
            hash.update(chunk);
            offset += chunk.length;
            onBytes?.(chunk.length);
            await out.write(chunk);
          }
        } else {
          await res.body.dump();
          if (res.statusCode === 404) throw importError(`blob ${digest} of ${registry}/${repository} was not found`);
          throw importError(`registry ${registry} answered ${res.statusCode} for blob ${digest}`);
        }
      } catch (err) {
        await out.close();
        if ((err as { detail?: unknown }).detail || opts.signal?.aborted) throw err; // a verdict or a cancel, not a cut connection
        lastError = err;
        continue;
      }
      await out.close();
      try {
        const got = `sha256:${hash.copy().digest("hex")}`;
        if (got !== digest) throw importError(`blob ${digest} of ${registry}/${repository} does not match its digest (got ${got})`);
        await rename(partial, dest);
        return offset;
      } catch (err) {
        await rm(partial, { force: true });
        throw err;
      }
    }
    throw importError(`blob ${digest} of ${registry}/${repository} could not be downloaded after ${BLOB_ATTEMPTS} attempts: ${(lastError as Error)?.message}`);
  }

  return { registry, getManifest, downloadBlob, close: () => dispatcher.close() };
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
