// An image — from a registry or from an OCI layout dir a Dockerfile builder wrote — turned into SourceLayers:
// manifest and platform chosen, each layer downloaded once and unpacked once into a dir keyed by its diff id.

import { existsSync } from "node:fs";
import { readFile, readdir, rename, rm } from "node:fs/promises";
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
import { MEDIA, importError, layerCompression } from "./types.ts";
import type { ImportEvents, SourceLayers } from "./types.ts";

export interface ImportOptions extends ImportEvents {
  /** Root of the importer's cache: `<KILN_CACHE_DIR>/oci` (blobs/, layers/). */
  cacheDir: string;
  auth?: BaseImageAuth;
  insecureRegistries?: string[];
  arch?: string;
  timeoutMs?: number;
  signal?: AbortSignal;
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

/** Where a layer is fetched from: a registry download or a file already on disk. */
type BlobSource = (layer: LayerDescriptor, onBytes: (n: number) => void) => Promise<{ path: string; transient: boolean }>;

const PARALLEL_LAYERS = 3;
const inFlight = new Map<string, Promise<string>>();

export async function importImage(reference: string, opts: ImportOptions): Promise<ImportedImage> {
  const ref = parseReference(reference);
  const client = createRegistryClient(ref.registry, { auth: opts.auth, insecureRegistries: opts.insecureRegistries, timeoutMs: opts.timeoutMs, signal: opts.signal });
  try {
    opts.onMessage?.(`resolving ${formatReference(ref)}`);
    let manifest = await client.getManifest(ref.repository, ref.digest ?? ref.tag!);
    if (manifest.mediaType === MEDIA.ociIndex || manifest.mediaType === MEDIA.dockerList) {
      const chosen = selectPlatform((manifest.json.manifests ?? []) as PlatformDescriptor[], opts.arch ?? hostArchitecture());
      opts.onMessage?.(`platform ${platformName(chosen)} → manifest ${chosen.digest}`);
      manifest = await client.getManifest(ref.repository, chosen.digest);
    }
    if (manifest.mediaType !== MEDIA.ociManifest && manifest.mediaType !== MEDIA.dockerManifest) {
      throw importError(`image ${formatReference(ref)} has an unsupported manifest type ${JSON.stringify(manifest.mediaType)}`);
    }
    const configDesc = manifest.json.config as { digest: string } | undefined;
    if (!configDesc?.digest) throw importError(`the manifest ${manifest.digest} has no config`);
    const configPath = blobPath(opts.cacheDir, configDesc.digest);
    if (!existsSync(configPath)) await once(configPath, () => client.downloadBlob(ref.repository, configDesc.digest, configPath).then(() => configPath));
    const configBody = await readFile(configPath);
    const source: BlobSource = async (layer, onBytes) => {
      const path = blobPath(opts.cacheDir, layer.digest);
      if (!existsSync(path)) await once(path, () => client.downloadBlob(ref.repository, layer.digest, path, onBytes).then(() => path));
      return { path, transient: true };
    };
    const result = await materialise(manifest.json, configBody, manifest.digest, source, opts);
    return { ...result, digest: manifest.digest, reference: formatReference(ref) };
  } finally {
    await client.close();
  }
}

/** An OCI image layout directory (what `buildah push oci:…` or `buildctl --output type=oci` write). */
export async function importOciLayout(layoutDir: string, opts: ImportOptions): Promise<ImportedImage> {
  const read = async (digest: string) => readFile(join(layoutDir, "blobs", ...digest.split(":")));
  let index = JSON.parse(await readFile(join(layoutDir, "index.json"), "utf8")) as { manifests?: PlatformDescriptor[] };
  let desc = index.manifests?.[0];
  for (let depth = 0; desc && (desc.mediaType === MEDIA.ociIndex || desc.mediaType === MEDIA.dockerList); depth++) {
    if (depth > 2) throw importError("the builder's OCI layout nests indexes too deeply");
    index = JSON.parse((await read(desc.digest)).toString());
    desc = selectPlatform(index.manifests ?? [], opts.arch ?? hostArchitecture());
  }
  if (!desc) throw importError("the builder's OCI layout has no image");
  const manifest = JSON.parse((await read(desc.digest)).toString()) as Record<string, unknown>;
  const configBody = await read((manifest.config as { digest: string }).digest);
  const source: BlobSource = async (layer) => ({ path: join(layoutDir, "blobs", ...layer.digest.split(":")), transient: false });
  const result = await materialise(manifest, configBody, desc.digest, source, opts);
  return { ...result, digest: desc.digest, reference: `oci:${layoutDir}` };
}

async function materialise(
  manifest: Record<string, unknown>,
  configBody: Buffer,
  manifestDigest: string,
  source: BlobSource,
  opts: ImportOptions,
): Promise<SourceLayers & { userIds?: { uid: number; gid: number } }> {
  let config: OciImageConfig;
  try {
    config = JSON.parse(configBody.toString());
  } catch {
    throw importError(`the config of manifest ${manifestDigest} is not JSON`);
  }
  if (config.os && config.os !== "linux") throw importError(`manifest ${manifestDigest} is for ${config.os}, not linux`);
  rejectOsRequirements(config, `manifest ${manifestDigest}`);
  const arch = opts.arch ?? hostArchitecture();
  if (config.architecture && config.architecture !== arch) throw importError(`manifest ${manifestDigest} is for ${config.architecture}; this host runs ${arch}`);
  const descs = (manifest.layers ?? []) as { digest: string; mediaType: string; size: number }[];
  const diffIds = config.rootfs?.diff_ids ?? [];
  if (diffIds.length !== descs.length) throw importError(`manifest ${manifestDigest} lists ${descs.length} layers but its config records ${diffIds.length} diff ids`);
  const layers: LayerDescriptor[] = descs.map((d, i) => ({ digest: d.digest, mediaType: d.mediaType, size: Number(d.size) || 0, diffId: diffIds[i] }));
  for (const l of layers) {
    if (!layerCompression(l.mediaType)) throw importError(`layer ${l.digest} has an unsupported media type ${JSON.stringify(l.mediaType)}`);
    if (!/^sha256:[a-f0-9]{64}$/.test(l.digest) || !/^sha256:[a-f0-9]{64}$/.test(l.diffId)) throw importError(`layer ${l.digest} has a digest Kiln cannot check`);
  }

  await sweepAbandoned(join(opts.cacheDir, "layers"));
  const total = layers.reduce((n, l) => n + l.size, 0);
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
  const dirs: string[] = new Array(layers.length);
  let next = 0;
  const worker = async () => {
    while (next < layers.length) {
      if (opts.signal?.aborted) throw importError("the import was cancelled");
      const i = next++;
      const layer = layers[i];
      const dir = layerDir(opts.cacheDir, layer.diffId);
      if (existsSync(dir)) {
        dirs[i] = dir;
        done++;
        opts.onLayer?.({ digest: layer.diffId, outcome: "hit", bytes: layer.size });
        opts.onMessage?.(`layer ${done}/${layers.length} ${short(layer.diffId)} cached`);
        continue;
      }
      opts.onLayer?.({ digest: layer.diffId, outcome: "miss", bytes: layer.size });
      dirs[i] = await once(dir, async () => {
        const blob = await source(layer, onBytes);
        const tmp = `${dir}.tmp-${process.pid}-${Date.now()}`;
        try {
          await unpackLayer(blob.path, layerCompression(layer.mediaType)!, tmp, layer.diffId);
          await rename(tmp, dir).catch((err) => (existsSync(dir) ? undefined : Promise.reject(err)));
        } finally {
          await rm(tmp, { recursive: true, force: true });
          // The unpacked dir is the cache; the compressed blob would only double the disk it takes.
          if (blob.transient) await rm(blob.path, { force: true });
        }
        return dir;
      });
      done++;
      opts.onLayer?.({ digest: layer.diffId, outcome: "stored", bytes: layer.size });
      opts.onMessage?.(`layer ${done}/${layers.length} ${short(layer.diffId)} ${mb(layer.size)} unpacked`);
    }
  };
  await Promise.all(Array.from({ length: Math.min(PARALLEL_LAYERS, layers.length) }, worker));

  const passwd = (await readFromStack(dirs, "/etc/passwd"))?.toString();
  const group = (await readFromStack(dirs, "/etc/group"))?.toString();
  const { rawUser, ...rest } = imageConfigOf(config);
  const ids = rawUser ? resolveUser(rawUser, passwd, group) : undefined;
  const accounts = accountFiles(passwd, group, ids);
  const top = await ensureTopLayer(opts.cacheDir, { passwd: accounts.passwd, group: accounts.group });
  return {
    layers: [...layers.map((l, i) => ({ dir: dirs[i], digest: l.diffId })), top],
    // No User means root, as every container runtime reads it; machines run as the user by name.
    config: { ...rest, user: accounts.userName },
    ...(ids ? { userIds: ids } : {}),
  };
}

/**
 * Half-unpacked layers (`<hex>.tmp-<pid>-…`) of a process that died (kill -9, a crash) are removed; partial blob
 * downloads are kept on purpose, so the next import resumes them.
 */
export async function sweepAbandoned(layersDir: string): Promise<void> {
  const names = await readdir(layersDir).catch(() => [] as string[]);
  for (const name of names) {
    const m = /\.tmp-(\d+)-/.exec(name);
    if (m && !alive(Number(m[1]))) await rm(join(layersDir, name), { recursive: true, force: true });
  }
}

export function alive(pid: number): boolean {
  if (pid === process.pid) return true;
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}

/** `<cache>/layers/<hex>`: the unpacked layer for a diff id. */
export function layerDir(cacheDir: string, diffId: string): string {
  return join(cacheDir, "layers", diffId.replace(/^sha256:/, ""));
}

function blobPath(cacheDir: string, digest: string): string {
  return join(cacheDir, "blobs", ...digest.split(":"));
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
