// The `buildkit` backend: a user's Dockerfile built by a real Dockerfile builder — a BuildKit daemon through
// buildctl when BUILDKIT_HOST is set, else Buildah (vfs storage, chroot isolation) — and its OCI output imported.
//
// Kiln never interprets the Dockerfile's instructions; it only reads FROM and --from operands to match credentials
// to registry hosts and to find FROM names that are Kiln templates. Secrets and registry passwords reach only the
// builder process, as files in a private (0700) scratch directory that is removed with the builder's storage.

import { spawn } from "node:child_process";
import { existsSync, lstatSync, readFileSync, realpathSync } from "node:fs";
import { chmod, copyFile, mkdir, mkdtemp, readdir, rm, writeFile } from "node:fs/promises";
import { isAbsolute, join, relative, resolve } from "node:path";
import { HOST_ID_BASE, ID_RANGE } from "../../runtime/oci/idmap.ts";
import { KilnError } from "../../errors.ts";
import type { BaseImageAuth } from "../oci/auth.ts";
import { credentialFor } from "../oci/auth.ts";
import { alive, importOciLayout } from "../oci/import.ts";
import type { ImportLimits } from "../oci/limits.ts";
import { parseReference, sameRegistry } from "../oci/reference.ts";
import { importError } from "../oci/types.ts";
import type { ImportEvents, SourceLayers } from "../oci/types.ts";
import { dockerfileImages, externalFroms } from "./dockerfile-images.ts";

export interface RegistryCredentialInput {
  registry: string;
  username: string;
  password: string;
}

export interface DockerfileBuild extends ImportEvents {
  /** The build context: a directory on disk, or the uploaded files (blobs) the backend lays out in its scratch dir. */
  contextDir?: string;
  contextFiles?: ContextFileInput[];
  /** Inline Dockerfile text; when absent, `dockerfilePath` (default `Dockerfile`) inside the context is used. */
  dockerfile?: string;
  dockerfilePath?: string;
  buildArgs?: Record<string, string>;
  target?: string;
  secrets?: { id: string; value: string }[];
  registryCredentials?: RegistryCredentialInput[];
  baseImageAuth?: BaseImageAuth;
  /** FROM names that are Kiln templates resolve here to their layers; anything else is pulled by the builder. */
  resolveTemplate?: (name: string) => Promise<SourceLayers | undefined>;
  /** The importer's cache (`$KILN_DATA_DIR/oci`). */
  cacheDir: string;
  /** KILN_OCI_MAX_* for importing the built image; the defaults when not given. */
  ociLimits?: ImportLimits;
  /** Parent of the per-build scratch directory (builder storage, secrets, output); on the data disk. */
  scratchParent: string;
  insecureRegistries?: string[];
  /** `BUILDKIT_HOST`: a BuildKit daemon address; unset means Buildah. */
  buildkitHost?: string;
  /** Called with the scratch dir just before it is removed (diagnostics; the tests search it for secrets). */
  beforeCleanup?: (scratch: string) => Promise<void>;
  signal?: AbortSignal;
}

/** An uploaded context file: its path in the context and where its verified bytes are. */
export interface ContextFileInput {
  path: string;
  blobPath: string;
  /** Octal permission bits ("0755" or 0o755); files are 0644 otherwise. */
  mode?: string | number;
}

const SECRET_ID = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$/;
const OUTPUT_TAG = "kiln-build-output";

/** What the Dockerfile says, checked before any stream starts: a bad request is an `invalid_request` error. */
export function validateDockerfileBuild(b: Pick<DockerfileBuild, "contextDir" | "contextFiles" | "dockerfile" | "dockerfilePath" | "secrets" | "registryCredentials" | "baseImageAuth">): { text: string; hosts: string[] } {
  const bad = (message: string) => new KilnError("invalid_request", message);
  let text = b.dockerfile;
  if (text === undefined || b.dockerfilePath !== undefined) {
    const path = b.dockerfilePath ?? "Dockerfile";
    if (isAbsolute(path) || path.split("/").includes("..")) throw bad(`dockerfile_path ${JSON.stringify(path)} must be a relative path inside the build context`);
    if (b.contextFiles) {
      const norm = path.replace(/^\.\//, "");
      const file = b.contextFiles.find((f) => f.path.replace(/^\.?\//, "") === norm);
      if (!file) throw bad(`dockerfile_path ${JSON.stringify(path)} is not a file in the build context`);
      text = readFileSync(file.blobPath, "utf8");
    } else {
      const dir = b.contextDir ?? ".";
      const full = resolve(dir, path);
      if (!existsSync(full) || !lstatSync(full).isFile()) throw bad(`dockerfile_path ${JSON.stringify(path)} is not a file in the build context`);
      if (relative(realpathSync(dir), realpathSync(full)).startsWith("..")) throw bad(`dockerfile_path ${JSON.stringify(path)} leads outside the build context`);
      text = readFileSync(full, "utf8");
    }
  }
  const ids = new Set<string>();
  for (const s of b.secrets ?? []) {
    if (!SECRET_ID.test(s.id)) throw bad(`secret id ${JSON.stringify(s.id)} must be letters, digits, '.', '_' or '-'`);
    if (ids.has(s.id)) throw bad(`secret id ${JSON.stringify(s.id)} is given twice`);
    ids.add(s.id);
  }
  const images = dockerfileImages(text);
  const external = externalFroms(images);
  const hostOf = (image: string) => {
    try {
      return parseReference(image).registry;
    } catch {
      return undefined;
    }
  };
  const named = [...external.filter((f) => !f.image.includes("$")).map((f) => f.image), ...images.implicit.map((i) => i.image)];
  const hosts = [...new Set(named.map(hostOf).filter((h): h is string => !!h))];
  for (const c of b.registryCredentials ?? []) {
    if (!hosts.some((h) => sameRegistry(h, c.registry))) {
      throw bad(`registry_credentials names ${JSON.stringify(c.registry)}, which the Dockerfile does not pull from (it uses ${hosts.join(", ") || "no registry"})`);
    }
  }
  if (b.baseImageAuth) {
    const variable = external.find((f) => f.image.includes("$"));
    if (variable) throw bad(`base_image_auth cannot be used with a variable-based FROM (line ${variable.line}: ${variable.image})`);
    if (images.implicit.length) throw bad(`base_image_auth cannot be used with an image imported as a stage by --from (line ${images.implicit[0].line}: ${images.implicit[0].image})`);
    if (hosts.length > 1) throw bad(`base_image_auth applies to one registry, but the Dockerfile pulls from ${hosts.join(", ")}`);
  }
  return { text, hosts };
}

/** Runs the build and imports its image; the builder's storage and every secret file are gone when this returns. */
export async function buildDockerfile(b: DockerfileBuild): Promise<SourceLayers> {
  const { text, hosts } = validateDockerfileBuild(b);
  await mkdir(b.scratchParent, { recursive: true });
  await chmod(b.scratchParent, 0o711);
  await sweepScratch(b.scratchParent);
  const scratch = await mkdtemp(join(b.scratchParent, `bld-${process.pid}-`));
  // Traversable, not listable: RUN steps run as the machines' unprivileged uids and must reach their rootfs below
  // here; the secret and auth dirs inside stay 0700 (the builder, host root, reads them).
  await chmod(scratch, 0o711);
  try {
    // No context at all is an empty one: a Dockerfile without COPY needs none.
    const contextDir = b.contextDir ?? (await layOutContext(join(scratch, "context"), b.contextFiles ?? []));
    const dockerfile = join(scratch, "Dockerfile");
    await writeFile(dockerfile, text, { mode: 0o600 });
    const secretArgs: string[] = [];
    await mkdir(join(scratch, "secrets"), { mode: 0o700 });
    for (const [i, s] of (b.secrets ?? []).entries()) {
      const file = join(scratch, "secrets", String(i));
      await writeFile(file, s.value, { mode: 0o600 });
      secretArgs.push("--secret", `id=${s.id},src=${file}`);
    }
    const auths: Record<string, Record<string, string>> = {};
    for (const c of b.registryCredentials ?? []) auths[authKey(c.registry)] = { auth: Buffer.from(`${c.username}:${c.password}`).toString("base64") };
    if (b.baseImageAuth && hosts.length === 1) {
      const cred = credentialFor(b.baseImageAuth, hosts[0]);
      if (cred?.kind === "basic") auths[authKey(hosts[0])] = { auth: Buffer.from(`${cred.username}:${cred.password}`).toString("base64") };
      if (cred?.kind === "bearer") auths[authKey(hosts[0])] = { registrytoken: cred.token };
    }
    const authFile = join(scratch, "auth", "config.json");
    await mkdir(join(scratch, "auth"), { mode: 0o700 });
    await writeFile(authFile, JSON.stringify({ auths }), { mode: 0o600 });
    const out = join(scratch, "out");
    // A RUN that prints a secret must not put it in the build log: every secret value is masked in builder output.
    const hidden = secretValues(b);
    const onLine = (line: string) => b.onMessage?.(mask(line, hidden));
    if (b.buildkitHost) await buildWithBuildctl(b, contextDir, scratch, secretArgs, out, onLine);
    else await buildWithBuildah(b, contextDir, scratch, dockerfile, secretArgs, authFile, out, onLine);
    return await importOciLayout(out, { cacheDir: b.cacheDir, limits: b.ociLimits, onMessage: b.onMessage, onLayer: b.onLayer });
  } catch (err) {
    const e = err as Error;
    if (hiddenIn(e.message, b)) throw importError(mask(e.message, secretValues(b)));
    throw err;
  } finally {
    await b.beforeCleanup?.(scratch).catch(() => {});
    await removeScratch(scratch);
  }
}

function authSecrets(auth: BaseImageAuth | undefined): string[] {
  if (!auth) return [];
  if (auth.type === "basic") return [auth.password];
  if (auth.type === "token") return [auth.token];
  return [typeof auth.config === "string" ? auth.config : JSON.stringify(auth.config)];
}

function secretValues(b: DockerfileBuild): string[] {
  return [...(b.secrets ?? []).map((s) => s.value), ...(b.registryCredentials ?? []).map((c) => c.password), ...authSecrets(b.baseImageAuth)].filter((v) => v.length >= 4);
}

function hiddenIn(text: string, b: DockerfileBuild): boolean {
  return secretValues(b).some((v) => text.includes(v));
}

function mask(text: string, values: string[]): string {
  let out = text;
  for (const v of values) out = out.split(v).join("[secret]");
  return out;
}

/** The uploaded context files at their paths (copies: the builder may change them), with their modes. */
async function layOutContext(dir: string, files: ContextFileInput[]): Promise<string> {
  await mkdir(dir, { recursive: true });
  await chmod(dir, 0o755);
  for (const f of files) {
    const rel = f.path.replace(/^\.?\/+/, "");
    if (!rel || isAbsolute(rel) || rel.split("/").includes("..")) throw new KilnError("invalid_request", `context path ${JSON.stringify(f.path)} must stay inside the context`);
    const dest = join(dir, rel);
    // Directories the context implies are 0755, as on a developer's machine (COPY keeps them): set by hand, since
    // Kiln's own umask (077) would make them 0700 and close them to the image's non-root users.
    const parts = rel.split("/").slice(0, -1);
    for (let i = 1; i <= parts.length; i++) {
      const sub = join(dir, ...parts.slice(0, i));
      if ((await mkdir(sub, { recursive: true })) !== undefined) await chmod(sub, 0o755);
    }
    await copyFile(f.blobPath, dest);
    const mode = typeof f.mode === "string" ? parseInt(f.mode, 8) : f.mode;
    await chmod(dest, Number.isInteger(mode) ? mode! & 0o7777 : 0o644);
  }
  return dir;
}

/** Docker Hub's credentials live under docker.io in containers' auth files. */
function authKey(registry: string): string {
  return sameRegistry(registry, "docker.io") ? "docker.io" : registry.replace(/^https?:\/\//, "").replace(/\/.*$/, "");
}

async function buildWithBuildah(b: DockerfileBuild, contextDir: string, scratch: string, dockerfile: string, secretArgs: string[], authFile: string, out: string, onLine: (l: string) => void) {
  // The storage's default id mapping is the machines': RUN steps are root only inside a user namespace (host uid
  // 100000, not host root), and every image layer — pulled, or a Kiln template committed here — is laid out for it.
  const idMap = `0:${HOST_ID_BASE}:${ID_RANGE}`;
  const storage = ["--root", join(scratch, "root"), "--runroot", join(scratch, "runroot"), "--storage-driver", "vfs", "--userns-uid-map", idMap, "--userns-gid-map", idMap];
  await mkdir(join(scratch, "tmp"));
  await chmod(join(scratch, "tmp"), 0o711);
  const conf = join(scratch, "registries.conf");
  const insecure = (b.insecureRegistries ?? []).map((h) => `[[registry]]\nlocation = ${JSON.stringify(h)}\ninsecure = true\n`).join("\n");
  await writeFile(conf, `unqualified-search-registries = ["docker.io"]\nshort-name-mode = "permissive"\n\n${insecure}`);
  const env = { ...process.env, TMPDIR: join(scratch, "tmp"), CONTAINERS_REGISTRIES_CONF: conf, BUILDAH_ISOLATION: "chroot", REGISTRY_AUTH_FILE: authFile };
  const buildah = (args: string[], lines = onLine) => run("buildah", [...storage, ...args], env, lines, b.signal);

  for (const f of externalFroms(dockerfileImages(readFileSync(dockerfile, "utf8")))) {
    const layers = f.image.includes("$") ? undefined : await b.resolveTemplate?.(f.image);
    if (layers) await importTemplate(buildah, scratch, f.image, layers, onLine);
  }
  const args = ["bud", "--isolation", "chroot", "--layers=false", "--authfile", authFile, "-f", dockerfile, "-t", OUTPUT_TAG];
  for (const [k, v] of Object.entries(b.buildArgs ?? {})) args.push("--build-arg", `${k}=${v}`);
  if (b.target) args.push("--target", b.target);
  args.push(...secretArgs, contextDir);
  await buildah(args);
  // Uncompressed layers: the importer reads them straight off the disk, and nothing goes over a network.
  await buildah(["push", "--disable-compression", "--quiet", OUTPUT_TAG, `oci:${out}:latest`]);
}

/**
 * A Kiln template named by FROM, given to Buildah as a local image of that name: its stacked layers (read through
 * a read-only overlay mount, so whiteouts apply) copied into a scratch container mapped like the machines, and
 * committed as `localhost/<name>`, which Buildah finds before looking at any registry.
 */
async function importTemplate(buildah: (args: string[], lines?: (l: string) => void) => Promise<string>, scratch: string, name: string, layers: SourceLayers, onLine: (l: string) => void) {
  onLine(`FROM ${name}: Kiln template (${layers.layers.length} layers)`);
  // The storage is mapped like the layers themselves: files keep their 100000+ owners on disk, and the commit
  // writes them as the image's own 0-based ids.
  const ctr = (await buildah(["from", "--quiet", "scratch"], () => {})).trim();
  const mnt = (await buildah(["mount", ctr], () => {})).trim();
  const merged = join(scratch, "template-view");
  const empty = join(scratch, "template-empty");
  await mkdir(merged);
  await mkdir(empty);
  const lower = [...layers.layers.map((l) => l.dir), empty].reverse().join(":");
  await run("mount", ["-t", "overlay", "overlay", "-o", `ro,lowerdir=${lower}`, merged], process.env, () => {});
  try {
    await run("cp", ["-a", `${merged}/.`, `${mnt}/`], process.env, onLine);
  } finally {
    await run("umount", [merged], process.env, () => {});
  }
  await buildah(["umount", ctr], () => {});
  // The template's image config goes with it: a Dockerfile on top inherits its env, working dir and user.
  const cfg = layers.config;
  const configArgs = Object.entries(cfg.env).flatMap(([k, v]) => ["--env", `${k}=${v}`]);
  if (cfg.workingDir) configArgs.push("--workingdir", cfg.workingDir);
  if (cfg.user) configArgs.push("--user", cfg.user);
  if (configArgs.length) await buildah(["config", ...configArgs, ctr], () => {});
  const ref = parseReference(name);
  const local = `localhost/${name.replace(/:[^/:]*$/, "")}:${ref.tag ?? "latest"}`;
  await buildah(["commit", "--quiet", "--format", "oci", ctr, local], () => {});
  await buildah(["rm", ctr], () => {});
}

async function buildWithBuildctl(b: DockerfileBuild, contextDir: string, scratch: string, secretArgs: string[], out: string, onLine: (l: string) => void) {
  const tar = join(scratch, "image.tar");
  const args = ["--addr", b.buildkitHost!, "build", "--progress", "plain", "--frontend", "dockerfile.v0", "--local", `context=${contextDir}`, "--local", `dockerfile=${scratch}`, "--opt", "filename=Dockerfile"];
  for (const [k, v] of Object.entries(b.buildArgs ?? {})) args.push("--opt", `build-arg:${k}=${v}`);
  if (b.target) args.push("--opt", `target=${b.target}`);
  args.push(...secretArgs, "--output", `type=oci,dest=${tar},compression=uncompressed`);
  // buildctl reads registry credentials from $DOCKER_CONFIG/config.json: the auth file written for this build.
  await run("buildctl", args, { ...process.env, DOCKER_CONFIG: join(scratch, "auth") }, onLine, b.signal);
  await mkdir(out);
  await run("tar", ["-xf", tar, "-C", out], process.env, onLine);
  await rm(tar, { force: true });
}

/** Scratch dirs of a Kiln that died mid-build (kill -9): their builder storage and secret files go now. */
async function sweepScratch(parent: string): Promise<void> {
  for (const name of await readdir(parent).catch(() => [] as string[])) {
    const m = /^bld-(\d+)-/.exec(name);
    if (m && !alive(Number(m[1]))) await removeScratch(join(parent, name));
  }
}

/** Unmounts anything left mounted below the scratch dir (a killed RUN), then removes it. */
async function removeScratch(scratch: string) {
  const mounts = readFileSync("/proc/self/mounts", "utf8")
    .split("\n")
    .map((l) => l.split(" ")[1]?.replace(/\\040/g, " "))
    .filter((m): m is string => !!m && (m === scratch || m.startsWith(`${scratch}/`)))
    .sort((a, b) => b.length - a.length);
  for (const m of mounts) await run("umount", ["-l", m], process.env, () => {}).catch(() => {});
  await rm(scratch, { recursive: true, force: true });
}

/** Runs a builder command; its output goes to `onLine` line by line. A failure becomes a build_error with its tail. */
function run(cmd: string, args: string[], env: NodeJS.ProcessEnv, onLine: (line: string) => void, signal?: AbortSignal): Promise<string> {
  return new Promise((resolvePromise, reject) => {
    const child = spawn(cmd, args, { env, stdio: ["ignore", "pipe", "pipe"], signal, killSignal: "SIGKILL" });
    let stdout = "";
    let tail = "";
    let partial = "";
    const feed = (chunk: Buffer, keep: boolean) => {
      const s = chunk.toString();
      if (keep) stdout += s;
      tail = (tail + s).slice(-2000);
      const lines = (partial + s).split("\n");
      partial = lines.pop() ?? "";
      for (const l of lines) if (l.trim()) onLine(l.trimEnd());
    };
    child.stdout.on("data", (c: Buffer) => feed(c, true));
    child.stderr.on("data", (c: Buffer) => feed(c, false));
    child.on("error", (e) => reject(importError(`${cmd} could not run: ${e.message}`)));
    child.on("close", (code) => {
      if (partial.trim()) onLine(partial.trimEnd());
      if (code === 0) resolvePromise(stdout);
      else reject(importError(`the Dockerfile build failed: ${cmd} exited ${code}: ${lastLines(tail)}`));
    });
  });
}

function lastLines(text: string): string {
  return text.trim().split("\n").slice(-3).join(" | ");
}
