// A real OCI registry on loopback for the importer's tests (Debian's docker-registry, optional bcrypt htpasswd),
// and a small writer that builds test images — tar layers, manifests, indexes — and pushes them into it.

import { execFileSync, spawn } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { createHash } from "node:crypto";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { gzipSync, zstdCompressSync } from "node:zlib";
import { pack } from "tar-stream";
import { request } from "undici";

export interface TestRegistry {
  host: string;
  auth?: { username: string; password: string };
  stop(): Promise<void>;
}

export function registryAvailable(): string | undefined {
  if (process.getuid?.() !== 0) return "the importer writes layers owned by the machines' uids (needs root)";
  for (const cmd of ["docker-registry", "htpasswd", "setfattr"]) {
    try {
      execFileSync("sh", ["-c", `command -v ${cmd}`], { stdio: "ignore" });
    } catch {
      return `${cmd} is not installed (scripts/up.sh installs it)`;
    }
  }
  return undefined;
}

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const port = (s.address() as { port: number }).port;
      s.close(() => resolve(port));
    });
  });
}

export async function startRegistry(opts: { auth?: { username: string; password: string } } = {}): Promise<TestRegistry> {
  const dir = await mkdtemp(join(tmpdir(), "kiln-registry-"));
  const port = await freePort();
  const host = `127.0.0.1:${port}`;
  let authBlock = "";
  if (opts.auth) {
    const line = execFileSync("htpasswd", ["-Bbn", opts.auth.username, opts.auth.password]).toString().trim();
    await writeFile(join(dir, "htpasswd"), `${line}\n`);
    authBlock = `auth:\n  htpasswd:\n    realm: kiln-test\n    path: ${join(dir, "htpasswd")}\n`;
  }
  await writeFile(
    join(dir, "config.yml"),
    `version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: ${join(dir, "data")}\n  delete:\n    enabled: true\nhttp:\n  addr: ${host}\n${authBlock}`,
  );
  const child: ChildProcess = spawn("docker-registry", ["serve", join(dir, "config.yml")], { stdio: ["ignore", "ignore", "pipe"] });
  let stderr = "";
  child.stderr!.on("data", (c) => (stderr = (stderr + c).slice(-4000)));
  for (let i = 0; ; i++) {
    const up = await request(`http://${host}/v2/`).then((r) => (r.body.dump(), true), () => false);
    if (up) break;
    if (i > 200 || child.exitCode !== null) throw new Error(`docker-registry did not start: ${stderr}`);
    await new Promise((r) => setTimeout(r, 25));
  }
  return {
    host,
    auth: opts.auth,
    async stop() {
      if (child.exitCode === null) {
        child.kill("SIGTERM");
        await new Promise((r) => child.once("exit", r));
      }
      await rm(dir, { recursive: true, force: true });
    },
  };
}

export interface TarEntry {
  name: string;
  type?: "file" | "directory" | "symlink" | "link" | "fifo" | "character-device";
  content?: string | Buffer;
  mode?: number;
  uid?: number;
  gid?: number;
  linkname?: string;
  mtime?: Date;
  pax?: Record<string, string>;
}

export async function tarOf(entries: TarEntry[]): Promise<Buffer> {
  const p = pack();
  const chunks: Buffer[] = [];
  p.on("data", (c) => chunks.push(c as Buffer));
  const ended = new Promise<void>((r) => p.on("end", () => r()));
  for (const e of entries) {
    const type = e.type ?? "file";
    const body = type === "file" ? Buffer.from(e.content ?? "") : undefined;
    p.entry(
      { name: e.name, type, mode: e.mode ?? (type === "directory" ? 0o755 : 0o644), uid: e.uid ?? 0, gid: e.gid ?? 0, linkname: e.linkname, mtime: e.mtime ?? new Date("2024-01-02T03:04:05Z"), pax: e.pax, size: body?.length ?? 0 },
      body ?? Buffer.alloc(0),
    );
  }
  p.finalize();
  await ended;
  return Buffer.concat(chunks);
}

export type Compression = "none" | "gzip" | "zstd";
const LAYER_TYPES: Record<Compression, string> = {
  none: "application/vnd.oci.image.layer.v1.tar",
  gzip: "application/vnd.oci.image.layer.v1.tar+gzip",
  zstd: "application/vnd.oci.image.layer.v1.tar+zstd",
};

export const sha256 = (b: Buffer | string) => `sha256:${createHash("sha256").update(b).digest("hex")}`;

function authHeaders(reg: TestRegistry): Record<string, string> {
  return reg.auth ? { authorization: `Basic ${Buffer.from(`${reg.auth.username}:${reg.auth.password}`).toString("base64")}` } : {};
}

export async function pushBlob(reg: TestRegistry, repo: string, body: Buffer): Promise<string> {
  const digest = sha256(body);
  const start = await request(`http://${reg.host}/v2/${repo}/blobs/uploads/`, { method: "POST", headers: authHeaders(reg) });
  await start.body.dump();
  if (start.statusCode !== 202) throw new Error(`blob upload start answered ${start.statusCode}`);
  const loc = new URL(String(start.headers.location), `http://${reg.host}`);
  loc.searchParams.set("digest", digest);
  const put = await request(loc, { method: "PUT", body, headers: { ...authHeaders(reg), "content-type": "application/octet-stream", "content-length": String(body.length) } });
  await put.body.dump();
  if (put.statusCode !== 201) throw new Error(`blob upload answered ${put.statusCode}`);
  return digest;
}

export async function pushManifest(reg: TestRegistry, repo: string, reference: string, mediaType: string, json: unknown): Promise<string> {
  const body = Buffer.from(JSON.stringify(json));
  const res = await request(`http://${reg.host}/v2/${repo}/manifests/${reference}`, { method: "PUT", body, headers: { ...authHeaders(reg), "content-type": mediaType } });
  const text = await res.body.text();
  if (res.statusCode !== 201) throw new Error(`manifest push answered ${res.statusCode}: ${text}`);
  return sha256(body);
}

export interface TestImage {
  layers: { entries?: TarEntry[]; tar?: Buffer; compression?: Compression }[];
  config?: Record<string, unknown>;
  architecture?: string;
  extraConfig?: Record<string, unknown>;
  /** Docker's media types (schema 2 manifest, rootfs.diff.tar.gzip layers) instead of OCI's. */
  docker?: boolean;
}

/** Pushes one image manifest (tag `tag`, or only by digest when tag is omitted); returns its digest and size. */
export async function pushImage(reg: TestRegistry, repo: string, tag: string | undefined, image: TestImage): Promise<{ digest: string; size: number }> {
  const descs = [];
  const diffIds = [];
  for (const layer of image.layers) {
    const tar = layer.tar ?? (await tarOf(layer.entries ?? []));
    const compression = layer.compression ?? "gzip";
    const blob = compression === "gzip" ? gzipSync(tar) : compression === "zstd" ? zstdCompressSync(tar) : tar;
    const layerType = image.docker ? (compression === "gzip" ? "application/vnd.docker.image.rootfs.diff.tar.gzip" : "application/vnd.docker.image.rootfs.diff.tar") : LAYER_TYPES[compression];
    descs.push({ mediaType: layerType, digest: await pushBlob(reg, repo, blob), size: blob.length });
    diffIds.push(sha256(tar));
  }
  const config = Buffer.from(
    JSON.stringify({ architecture: image.architecture ?? "amd64", os: "linux", config: image.config ?? {}, rootfs: { type: "layers", diff_ids: diffIds }, history: diffIds.map((_, i) => ({ created_by: `kiln test layer ${i + 1}` })), ...image.extraConfig }),
  );
  const configDigest = await pushBlob(reg, repo, config);
  const manifest = {
    schemaVersion: 2,
    mediaType: image.docker ? "application/vnd.docker.distribution.manifest.v2+json" : "application/vnd.oci.image.manifest.v1+json",
    config: { mediaType: image.docker ? "application/vnd.docker.container.image.v1+json" : "application/vnd.oci.image.config.v1+json", digest: configDigest, size: config.length },
    layers: descs,
  };
  const body = Buffer.from(JSON.stringify(manifest));
  const digest = await pushManifest(reg, repo, tag ?? sha256(body), manifest.mediaType, manifest);
  return { digest, size: body.length };
}

export async function pushIndex(reg: TestRegistry, repo: string, tag: string, manifests: { digest: string; size: number; platform: Record<string, unknown> }[], opts: { docker?: boolean } = {}): Promise<string> {
  const mediaType = opts.docker ? "application/vnd.docker.distribution.manifest.list.v2+json" : "application/vnd.oci.image.index.v1+json";
  const child = opts.docker ? "application/vnd.docker.distribution.manifest.v2+json" : "application/vnd.oci.image.manifest.v1+json";
  return pushManifest(reg, repo, tag, mediaType, {
    schemaVersion: 2,
    mediaType,
    manifests: manifests.map((m) => ({ mediaType: child, digest: m.digest, size: m.size, platform: m.platform })),
  });
}
