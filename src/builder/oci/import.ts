// An image — from a registry or from an OCI layout dir a Dockerfile builder wrote — turned into SourceLayers:
// manifest and platform chosen, each layer downloaded once and unpacked once into a dir keyed by its diff id.

import { createReadStream, existsSync } from "node:fs";
import { availableParallelism } from "node:os";
import { readFile, readdir, rename, rm, stat, utimes } from "node:fs/promises";
import { createHash } from "node:crypto";
import { join } from "node:path";
import { createRegistryClient } from "./registry.ts";
import type { BaseImageAuth } from "./auth.ts";
import { formatReference, parseReference } from "./reference.ts";
import { rejectOsRequirements, selectPlatform, hostArchitecture } from "./platform.ts";
import type { PlatformDescriptor } from "./platform.ts";
import { unpackLayer } from "./unpack.ts";
import { accountFiles, ensureTopLayer, readFromStack } from "./stack.ts";
import { imageConfigOf, resolveUser } from "./image-config.ts";
import type { OciImageConfig } from "./image-config.ts";
import { ByteBudget, DEFAULT_IMPORT_LIMITS, overLimit } from "./limits.ts";
import type { ImportLimits } from "./limits.ts";
import { MEDIA, checkDigest, importError, layerCompression } from "./types.ts";
import type { ImportEvents, SourceLayers } from "./types.ts";
import { pidAlive } from "../../runtime/pid-alive.ts";

export interface ImportOptions extends ImportEvents {
  /** Root of the importer's cache: `<KILN_CACHE_DIR>/oci` (blobs/, layers/). */
  cacheDir: string;
  auth?: BaseImageAuth;
  insecureRegistries?: string[];
  arch?: string;
  timeoutMs?: number;
  signal?: AbortSignal;
  /** The KILN_OCI_MAX_* bounds; DEFAULT_IMPORT_LIMITS when not given. */
  limits?: ImportLimits;
  /** Whether a machine can stack these layer dirs (the caller's mount rule), asked before anything is downloaded. */
  fits?: (layerDirs: string[]) => boolean;
}

export interface ImportedImage extends SourceLayers {
  /** The manifest actually unpacked (platform-specific), `sha256:…`: the source's identity in cache keys. */
  digest: string;
  reference: string;
  /** The image's User resolved to ids (the group of a `user:group` form is here; machines use the user's own). */
  userIds?: { uid: number; gid: number };
}

interface LayerDescriptor {
  digest: string;
  mediaType: string;
  size: number;
  diffId: string;
}

/**
 * A layer's compressed bytes, streamed from where they are: a registry download (checked against the layer's
 * digest as the iteration ends, see blobBytes) or a file already on disk.
 */
type BlobSource = (layer: LayerDescriptor, onBytes: (n: number) => void, signal: AbortSignal) => AsyncIterable<Buffer>;

/**
 * Layers streamed and unpacked at once. Each is a pipeline of network, sha256, inflate (zlib's thread pool), tar
 * parsing and file writes (the thread pool again) in which no stage is busy all the time: two per core keep the
 * cores busy, and four at most leave libuv's four pool threads to the rest of the server between chunks.
 */
const PARALLEL_LAYERS = Math.max(2, Math.min(4, 2 * availableParallelism()));
const inFlight = new Map<string, Promise<string>>();
const queued = new Map<string, Promise<void>>();
/** Cache paths (layer dirs, blobs) an import in this process is using: retention leaves them alone. */
const pins = new Map<string, number>();

export async function importImage(reference: string, opts: ImportOptions): Promise<ImportedImage> {
  const ref = parseReference(reference);
  const limits = opts.limits ?? DEFAULT_IMPORT_LIMITS;
  const client = createRegistryClient(ref.registry, { auth: opts.auth, insecureRegistries: opts.insecureRegistries, timeoutMs: opts.timeoutMs, signal: opts.signal, limits });
  const pinned: string[] = [];
  try {
    opts.onMessage?.(`resolving ${formatReference(ref)}`);
    let manifest = await client.getManifest(ref.repository, ref.digest ?? ref.tag!);
    if (manifest.mediaType === MEDIA.ociIndex || manifest.mediaType === MEDIA.dockerList) {
      const chosen = selectPlatform((manifest.json.manifests ?? []) as PlatformDescriptor[], opts.arch ?? hostArchitecture());
      checkDigest(chosen.digest, `the index of ${formatReference(ref)}`);
      opts.onMessage?.(`platform ${platformName(chosen)} → manifest ${chosen.digest}`);
      manifest = await client.getManifest(ref.repository, chosen.digest);
    }
    if (manifest.mediaType !== MEDIA.ociManifest && manifest.mediaType !== MEDIA.dockerManifest) {
      throw importError(`image ${formatReference(ref)} has an unsupported manifest type ${JSON.stringify(manifest.mediaType)}`);
    }
    const configDesc = configDescriptor(manifest.json, manifest.digest, limits);
    layerDescriptors(manifest.json, manifest.digest, limits); // every digest checked before anything is fetched
    const configPath = blobPath(opts.cacheDir, configDesc.digest);
    pin(configPath, pinned);
    if (!existsSync(configPath)) await once(configPath, () => client.downloadBlob(ref.repository, configDesc.digest, configDesc.size, configPath).then(() => configPath));
    const configBody = await readBounded(configPath, limits.configBytes, `the config of manifest ${manifest.digest}`, limits);
    await utimes(configPath, new Date(), new Date()).catch(() => {}); // last used: what retention goes by
    // Downloaded, verified and unpacked in one pass: the compressed blob is never read back. Its `.partial` beside
    // the blob path is kept only while it is incomplete (a later import resumes from it).
    const source: BlobSource = (layer, onBytes, signal) => {
      const path = blobPath(opts.cacheDir, layer.digest);
      pin(path, pinned);
      return client.blobBytes(ref.repository, layer.digest, layer.size, `${path}.partial`, { onBytes, signal });
    };
    const result = await materialise(manifest.json, configBody, manifest.digest, source, opts, pinned);
    return { ...result, digest: manifest.digest, reference: formatReference(ref) };
  } finally {
    unpin(pinned);
    await client.close();
  }
}

/** An OCI image layout directory (what `buildah push oci:…` or `buildctl --output type=oci` write). */
export async function importOciLayout(layoutDir: string, opts: ImportOptions): Promise<ImportedImage> {
  const limits = opts.limits ?? DEFAULT_IMPORT_LIMITS;
  /** A JSON blob of the layout, by a checked digest, within `max` bytes and matching its digest. */
  const readJson = async (digest: string, what: string, max: number, key: keyof ImportLimits) => {
    const body = await readBounded(join(layoutDir, "blobs", ...checkDigest(digest, what).split(":")), max, what, limits, key);
    if (`sha256:${createHash("sha256").update(body).digest("hex")}` !== digest) throw importError(`${what} in the builder's OCI layout does not match its digest`);
    return parseJson(body, what);
  };
  let index = parseJson(await readBounded(join(layoutDir, "index.json"), limits.manifestBytes, "the builder's OCI layout index", limits, "manifestBytes"), "the builder's OCI layout index") as { manifests?: PlatformDescriptor[] };
  let desc = index.manifests?.[0];
  for (let depth = 0; desc && (desc.mediaType === MEDIA.ociIndex || desc.mediaType === MEDIA.dockerList); depth++) {
    if (depth > 2) throw importError("the builder's OCI layout nests indexes too deeply");
    index = (await readJson(desc.digest, "an index", limits.manifestBytes, "manifestBytes")) as { manifests?: PlatformDescriptor[] };
    desc = selectPlatform(index.manifests ?? [], opts.arch ?? hostArchitecture());
  }
  if (!desc) throw importError("the builder's OCI layout has no image");
  const manifest = await readJson(desc.digest, "the manifest", limits.manifestBytes, "manifestBytes");
  const configDesc = configDescriptor(manifest, desc.digest, limits);
  const configBody = await readBounded(join(layoutDir, "blobs", ...configDesc.digest.split(":")), limits.configBytes, `the config of manifest ${desc.digest}`, limits);
  if (`sha256:${createHash("sha256").update(configBody).digest("hex")}` !== configDesc.digest) throw importError("the config in the builder's OCI layout does not match its digest");
  const source: BlobSource = (layer) => createReadStream(join(layoutDir, "blobs", ...layer.digest.split(":")), { highWaterMark: 1 << 20 });
  const pinned: string[] = [];
  try {
    const result = await materialise(manifest, configBody, desc.digest, source, opts, pinned);
    return { ...result, digest: desc.digest, reference: `oci:${layoutDir}` };
  } finally {
    unpin(pinned);
  }
}

/** The manifest's config descriptor, its digest checked and its declared size within KILN_OCI_MAX_CONFIG_BYTES. */
function configDescriptor(manifest: Record<string, unknown>, manifestDigest: string, limits: ImportLimits): { digest: string; size: number } {
  const desc = manifest.config as { digest?: unknown; size?: unknown } | undefined;
  if (!desc?.digest) throw importError(`the manifest ${manifestDigest} has no config`);
  const digest = checkDigest(desc.digest, `the config of manifest ${manifestDigest}`);
  const size = declaredSize(desc.size, `the config of manifest ${manifestDigest}`);
  if (size > limits.configBytes) throw overLimit(`the config of manifest ${manifestDigest} (${size} bytes declared)`, limits, "configBytes");
  return { digest, size };
}

/** The manifest's layers: within KILN_OCI_MAX_LAYERS, each digest checked, media type known, size declared. */
function layerDescriptors(manifest: Record<string, unknown>, manifestDigest: string, limits: ImportLimits): Omit<LayerDescriptor, "diffId">[] {
  const descs = (Array.isArray(manifest.layers) ? manifest.layers : []) as { digest: unknown; mediaType: string; size: unknown }[];
  if (descs.length > limits.layers) throw overLimit(`manifest ${manifestDigest}'s layer count (${descs.length})`, limits, "layers");
  return descs.map((d) => {
    const digest = checkDigest(d.digest, `a layer of manifest ${manifestDigest}`);
    if (!layerCompression(d.mediaType)) throw importError(`layer ${digest} has an unsupported media type ${JSON.stringify(d.mediaType)}`);
    return { digest, mediaType: d.mediaType, size: declaredSize(d.size, `layer ${digest}`) };
  });
}

async function materialise(
  manifest: Record<string, unknown>,
  configBody: Buffer,
  manifestDigest: string,
  source: BlobSource,
  opts: ImportOptions,
  pinned: string[],
): Promise<SourceLayers & { userIds?: { uid: number; gid: number } }> {
  const limits = opts.limits ?? DEFAULT_IMPORT_LIMITS;
  const config = parseJson(configBody, `the config of manifest ${manifestDigest}`) as OciImageConfig;
  if (config.os && config.os !== "linux") throw importError(`manifest ${manifestDigest} is for ${config.os}, not linux`);
  rejectOsRequirements(config, `manifest ${manifestDigest}`);
  const arch = opts.arch ?? hostArchitecture();
  if (config.architecture && config.architecture !== arch) throw importError(`manifest ${manifestDigest} is for ${config.architecture}; this host runs ${arch}`);
  const descs = layerDescriptors(manifest, manifestDigest, limits);
  const diffIds = Array.isArray(config.rootfs?.diff_ids) ? config.rootfs.diff_ids : [];
  if (diffIds.length !== descs.length) throw importError(`manifest ${manifestDigest} lists ${descs.length} layers but its config records ${diffIds.length} diff ids`);
  const layers: LayerDescriptor[] = descs.map((d, i) => ({ ...d, diffId: checkDigest(diffIds[i], `layer ${d.digest}'s diff id`) }));
  const total = layers.reduce((n, l) => n + l.size, 0);
  if (total > limits.imageBytes) throw overLimit(`manifest ${manifestDigest}'s layers (${total} bytes declared)`, limits, "imageBytes");
  if (opts.fits && !opts.fits(layers.map((l) => layerDir(opts.cacheDir, l.diffId)))) {
    throw importError(`manifest ${manifestDigest}'s ${layers.length} layers are too many to stack in one machine's root here (overlayfs takes one page of mount options)`);
  }

  await sweepAbandoned(join(opts.cacheDir, "layers"));
  let received = 0;
  let lastReport = 0;
  let done = 0;
  opts.onMessage?.(`${layers.length} layers, ${mb(total)}`);
  const onBytes = (n: number) => {
    received += n;
    const now = Date.now();
    if (now - lastReport >= 1000) {
      lastReport = now;
      opts.onMessage?.(`downloaded ${mb(received)} of ${mb(total)} (layers ${done}/${layers.length})`);
    }
  };
  // One layer failing stops the others (and a cancel stops all): nothing keeps writing once the import has failed.
  const stop = new AbortController();
  const signal = opts.signal ? AbortSignal.any([opts.signal, stop.signal]) : stop.signal;
  const budget = new ByteBudget(limits);
  const dirs: string[] = new Array(layers.length);
  let next = 0;
  const worker = async () => {
    while (next < layers.length) {
      if (signal.aborted) throw importError("the import was cancelled");
      const i = next++;
      const layer = layers[i];
      const dir = layerDir(opts.cacheDir, layer.diffId);
      pin(dir, pinned);
      if (existsSync(dir)) {
        await utimes(dir, new Date(), new Date()).catch(() => {}); // last used: what retention goes by
        dirs[i] = dir;
        done++;
        opts.onLayer?.({ digest: layer.diffId, outcome: "hit", bytes: layer.size });
        opts.onMessage?.(`layer ${done}/${layers.length} ${short(layer.diffId)} cached`);
        continue;
      }
      opts.onLayer?.({ digest: layer.diffId, outcome: "miss", bytes: layer.size });
      // One stream of this blob at a time in this process (two layers of one digest would share its partial file).
      dirs[i] = await once(dir, () =>
        exclusive(layer.digest, async () => {
          if (existsSync(dir)) return dir; // another image's import unpacked it while this one waited
          // Unpacked under a temporary name while the blob streams in; renamed into place only once the blob's
          // digest and the tar's diff id are both checked. Any failure before removes it: an unverified layer is
          // never where a machine or another import could use it.
          const tmp = `${dir}.tmp-${process.pid}-${Date.now()}`;
          let verified = false;
          const bytes = source(layer, onBytes, signal);
          async function* checked(): AsyncGenerator<Buffer> {
            yield* bytes;
            verified = true;
          }
          try {
            await unpackLayer(checked(), layerCompression(layer.mediaType)!, tmp, { expectDiffId: layer.diffId, limits, budget, signal });
            if (!verified) throw importError(`layer ${layer.digest} was unpacked before all of it was read`);
            await rename(tmp, dir).catch((err) => (existsSync(dir) ? undefined : Promise.reject(err)));
          } finally {
            await rm(tmp, { recursive: true, force: true });
          }
          return dir;
        }),
      );
      done++;
      opts.onLayer?.({ digest: layer.diffId, outcome: "stored", bytes: layer.size });
      opts.onMessage?.(`layer ${done}/${layers.length} ${short(layer.diffId)} ${mb(layer.size)} unpacked`);
    }
  };
  let failure: unknown;
  await Promise.all(
    Array.from({ length: Math.min(PARALLEL_LAYERS, layers.length) }, () =>
      worker().catch((err: unknown) => {
        failure ??= err;
        stop.abort();
      }),
    ),
  );
  if (failure) throw opts.signal?.aborted ? importError("the import was cancelled") : failure;

  const passwd = (await readFromStack(dirs, "/etc/passwd"))?.toString();
  const group = (await readFromStack(dirs, "/etc/group"))?.toString();
  const { rawUser, ...rest } = imageConfigOf(config);
  const ids = rawUser ? resolveUser(rawUser, passwd, group) : undefined;
  const accounts = accountFiles(passwd, group, ids);
  const top = await ensureTopLayer(opts.cacheDir, { passwd: accounts.passwd, group: accounts.group });
  pin(top.dir, pinned);
  await utimes(top.dir, new Date(), new Date()).catch(() => {});
  return {
    layers: [...layers.map((l, i) => ({ dir: dirs[i], digest: l.diffId })), top],
    // No User means root, as every container runtime reads it; machines run as the user by name.
    config: { ...rest, user: accounts.userName },
    ...(ids ? { userIds: ids } : {}),
  };
}

/** Whether an import in this process is using `path` (a layer dir or blob under the cache). */
export function isPinned(path: string): boolean {
  return pins.has(path);
}

function pin(path: string, held: string[]): void {
  pins.set(path, (pins.get(path) ?? 0) + 1);
  held.push(path);
}

function unpin(held: string[]): void {
  for (const path of held.splice(0)) {
    const n = (pins.get(path) ?? 1) - 1;
    if (n > 0) pins.set(path, n);
    else pins.delete(path);
  }
}

/** A descriptor's `size`: a whole number of bytes, as OCI requires (it bounds what Kiln will download). */
function declaredSize(size: unknown, what: string): number {
  if (typeof size !== "number" || !Number.isSafeInteger(size) || size < 0) throw importError(`${what} declares no valid size (${JSON.stringify(size)})`);
  return size;
}

/** A file of at most `max` bytes, read whole; a larger one is a build_error naming the setting. */
async function readBounded(path: string, max: number, what: string, limits: ImportLimits, key: keyof ImportLimits = "configBytes"): Promise<Buffer> {
  const st = await stat(path).catch(() => undefined);
  if (!st?.isFile()) throw importError(`${what} is missing`);
  if (st.size > max) throw overLimit(`${what} (${st.size} bytes)`, limits, key);
  return readFile(path);
}

function parseJson(body: Buffer, what: string): Record<string, unknown> {
  try {
    const v = JSON.parse(body.toString()) as unknown;
    if (v && typeof v === "object" && !Array.isArray(v)) return v as Record<string, unknown>;
  } catch {
    // phrased below
  }
  throw importError(`${what} is not a JSON object`);
}

/**
 * Half-unpacked layers (`<hex>.tmp-<pid>-…`) of a process that died (kill -9, a crash) are removed; partial blob
 * downloads are kept on purpose, so the next import resumes them.
 */
export async function sweepAbandoned(layersDir: string): Promise<void> {
  const names = await readdir(layersDir).catch(() => [] as string[]);
  for (const name of names) {
    const m = /\.tmp-(\d+)-/.exec(name);
    if (m && !pidAlive(Number(m[1]))) await rm(join(layersDir, name), { recursive: true, force: true });
  }
}

/** `<cache>/layers/<hex>`: the unpacked layer for a diff id. */
export function layerDir(cacheDir: string, diffId: string): string {
  return join(cacheDir, "layers", checkDigest(diffId, "a layer").slice("sha256:".length));
}

/** `<cache>/blobs/sha256/<hex>`, for a digest checkDigest has passed. */
function blobPath(cacheDir: string, digest: string): string {
  return join(cacheDir, "blobs", ...checkDigest(digest, "a blob").split(":"));
}

/** Runs `work` after every earlier `exclusive` of the same key in this process has settled. */
function exclusive<T>(key: string, work: () => Promise<T>): Promise<T> {
  const before = queued.get(key) ?? Promise.resolve();
  const p = before.then(work, work);
  const settled = p.then(
    () => {},
    () => {},
  );
  queued.set(key, settled);
  void settled.then(() => {
    if (queued.get(key) === settled) queued.delete(key);
  });
  return p;
}

/** One download or unpack per path at a time in this process; a second caller waits for the first. */
function once(key: string, work: () => Promise<string>): Promise<string> {
  const running = inFlight.get(key);
  if (running) return running;
  const p = work().finally(() => inFlight.delete(key));
  inFlight.set(key, p);
  return p;
}

function platformName(d: PlatformDescriptor): string {
  return [d.platform?.os, d.platform?.architecture, d.platform?.variant].filter(Boolean).join("/");
}

function mb(bytes: number): string {
  return `${(bytes / 1e6).toFixed(1)} MB`;
}

function short(digest: string): string {
  return digest.slice(0, 19);
}
