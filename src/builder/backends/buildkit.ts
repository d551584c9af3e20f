// The `buildkit` backend: a user's Dockerfile built by a real Dockerfile builder — a BuildKit daemon through
// buildctl when BUILDKIT_HOST is set, else Buildah (vfs storage, OCI isolation through runc) — and its OCI output
// imported.
//
// Kiln never interprets the Dockerfile's instructions; it only reads FROM and --from operands to match credentials
// to registry hosts and to find FROM names that are Kiln templates. Buildah and every RUN step run in the build's
// sandbox (isolation/sandbox.ts: own namespaces, host ids no machine has, cgroup limits, the machines' egress
// policy), are killed at a step or build timeout, on cancel and when Kiln dies. Secrets and registry passwords
// reach only the builder, as files in a private scratch directory removed with the builder's storage; build args
// reach it through its environment, never its command line.
// Long on purpose: the two real builders (buildctl, Buildah) share one request, context layout and output import.

import { lookup } from "node:dns/promises";
import { existsSync, lstatSync, readFileSync, realpathSync } from "node:fs";
import { chmod, copyFile, mkdir, mkdtemp, rm, rmdir, writeFile } from "node:fs/promises";
import { basename, isAbsolute, join, relative, resolve } from "node:path";
import { HOST_ID_BASE, ID_RANGE } from "../../runtime/oci/idmap.ts";
import { createEgress } from "../../runtime/oci/egress.ts";
import type { Egress } from "../../runtime/oci/egress.ts";
import { KilnError } from "../../errors.ts";
import type { BaseImageAuth } from "../oci/auth.ts";
import { credentialFor } from "../oci/auth.ts";
import { importOciLayout } from "../oci/import.ts";
import type { ImportLimits } from "../oci/limits.ts";
import { parseReference, sameRegistry } from "../oci/reference.ts";
import { importError } from "../oci/types.ts";
import type { ImportEvents, SourceLayers } from "../oci/types.ts";
import { dockerfileImages, externalFroms } from "./dockerfile-images.ts";
import { createGuard, run } from "./builder-process.ts";
import type { Guard, RunOptions } from "./builder-process.ts";
import { BUILD_HOST_ID_BASE, BUILD_ID_RANGE, openSandbox, ownerTag, sweepSandboxes } from "./isolation/sandbox.ts";
import type { Sandbox } from "./isolation/sandbox.ts";

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
  /** What each RUN step may use (the build request's `vm`); machines' defaults otherwise. */
  vm?: { vcpus: number; memoryMb: number; internet: boolean };
  /** KILN_MACHINE_HOST_ACCESS: RUN steps (and the builder's fetches) reach host loopback, as machines do. */
  hostAccess?: boolean;
  /** A step (from one `STEP n/m` of the builder to the next) and the whole build end with a build_error after these. */
  stepTimeoutMs?: number;
  buildTimeoutMs?: number;
  /** The host's egress filter (machines' nftables table); one is made when not given. */
  egress?: Egress;
  /** While the build log is behind its store, a promise to wait on before reading more builder output. */
  logBackpressure?: () => Promise<void> | undefined;
}

export const DOCKERFILE_DEFAULTS = { vcpus: 1, memoryMb: 1024, internet: true, stepTimeoutMs: 3_600_000, buildTimeoutMs: 14_400_000 } as const;

/**
 * Build args reach Buildah through its environment (`--build-arg NAME` reads the value from there), so a name the
 * builder itself reads from its environment cannot be one: it would steer the builder, not the Dockerfile.
 */
const BUILDER_ENV = /^(PATH|HOME|TMPDIR|TZ|NOTIFY_SOCKET|LISTEN_FDS|LISTEN_PID|LISTEN_FDNAMES|REGISTRY_AUTH_FILE|DOCKER_CONFIG|DOCKER_CERT_PATH|SSL_CERT_FILE|SSL_CERT_DIR|GODEBUG|GOGC|GOMAXPROCS|GOMEMLIMIT|GOTRACEBACK|GORACE)$|^(LD_|BUILDAH_|_BUILDAH|CONTAINERS_|_CONTAINERS|STORAGE_|XDG_)/;
/** Build args are an environment: together they must fit the kernel's argument and environment limit with room. */
const BUILD_ARGS_MAX_BYTES = 512 * 1024;

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
export function validateDockerfileBuild(
  b: Pick<DockerfileBuild, "contextDir" | "contextFiles" | "dockerfile" | "dockerfilePath" | "secrets" | "registryCredentials" | "baseImageAuth" | "buildArgs">,
): { text: string; hosts: string[] } {
  const bad = (message: string) => new KilnError("invalid_request", message);
  let argBytes = 0;
  for (const [name, value] of Object.entries(b.buildArgs ?? {})) {
    if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(name)) throw bad(`build arg ${JSON.stringify(name)} must be letters, digits and '_', not starting with a digit`);
    if (BUILDER_ENV.test(name)) throw bad(`build arg ${name} is a name the builder itself reads from its environment; rename the ARG`);
    if (value.includes("\0")) throw bad(`build arg ${name} contains a NUL byte`);
    argBytes += Buffer.byteLength(name) + Buffer.byteLength(value) + 2;
  }
  if (argBytes > BUILD_ARGS_MAX_BYTES) throw bad(`build_args total ${argBytes} bytes; at most ${BUILD_ARGS_MAX_BYTES} are accepted`);
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

let defaultEgress: Egress | undefined;

/** Runs the build and imports its image; the builder's storage, its sandbox and every secret file are gone when this returns. */
export async function buildDockerfile(b: DockerfileBuild): Promise<SourceLayers & { userIds?: { uid: number; gid: number } }> {
  const { text, hosts } = validateDockerfileBuild(b);
  await mkdir(b.scratchParent, { recursive: true });
  await chmod(b.scratchParent, 0o711);
  const egress = b.egress ?? (defaultEgress ??= createEgress());
  await sweepDockerfileBuilds(b.scratchParent, egress);
  // The name says which process owns the build, so a later start can tell a dead build's leftovers from a live one.
  const scratch = await mkdtemp(join(b.scratchParent, `bld-${ownerTag() ?? process.pid}-`));
  // Traversable, not listable: runc reaches the RUN steps' rootfs (and bind-mount sources) below here from inside
  // the build's user namespace; the secret, auth and state dirs inside stay 0700 (the builder, host root, reads them).
  await chmod(scratch, 0o711);
  const guard = createGuard(b.stepTimeoutMs ?? DOCKERFILE_DEFAULTS.stepTimeoutMs, b.buildTimeoutMs ?? DOCKERFILE_DEFAULTS.buildTimeoutMs);
  let sandbox: Sandbox | undefined;
  try {
    // The data dir itself may be private: the builder works through a bind mount every ancestor of which the
    // build's ids may traverse.
    const dir = b.buildkitHost ? scratch : await exposeScratch(scratch);
    // No context at all is an empty one: a Dockerfile without COPY needs none.
    const contextDir = b.contextDir ?? (await layOutContext(join(dir, "context"), b.contextFiles ?? []));
    const dockerfile = join(dir, "Dockerfile");
    await writeFile(dockerfile, text, { mode: 0o600 });
    const secretArgs: string[] = [];
    await mkdir(join(dir, "secrets"), { mode: 0o700 });
    for (const [i, s] of (b.secrets ?? []).entries()) {
      const file = join(dir, "secrets", String(i));
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
    const authFile = join(dir, "auth", "config.json");
    await mkdir(join(dir, "auth"), { mode: 0o700 });
    await writeFile(authFile, JSON.stringify({ auths }), { mode: 0o600 });
    const out = join(dir, "out");
    // A RUN that prints a secret must not put it in the build log: every secret value is masked in builder output.
    const hidden = secretValues(b);
    const onLine = (line: string) => {
      const shown = mask(line, hidden);
      guard.line(shown);
      b.onMessage?.(shown);
    };
    if (b.buildkitHost) {
      await buildWithBuildctl(b, contextDir, dir, secretArgs, out, onLine, guard);
    } else {
      const vm = b.vm ?? DOCKERFILE_DEFAULTS;
      // Only host root uses the state (namespace files, the shim's policy): it stays on the private path.
      await mkdir(join(scratch, "state"), { mode: 0o700 });
      sandbox = await openSandbox({
        key: basename(scratch),
        stateDir: join(scratch, "state"),
        internet: vm.internet,
        hostAccess: b.hostAccess ?? false,
        vcpus: vm.vcpus,
        memoryMb: vm.memoryMb,
        fetchAllow: await registryAddresses(b.insecureRegistries ?? []),
        egress,
      });
      await buildWithBuildah(b, contextDir, dir, dockerfile, secretArgs, authFile, out, onLine, sandbox, guard);
    }
    guard.check();
    // Hashing and unpacking a large image prints nothing for a while: a progress line every 10 s of silence.
    const t0 = Date.now();
    let last = t0;
    const said = (m: string) => {
      last = Date.now();
      b.onMessage?.(m);
    };
    const ticker = setInterval(() => {
      if (Date.now() - last >= 10_000) said(`still importing the built image (${Math.round((Date.now() - t0) / 1000)} s)`);
    }, 2_000);
    try {
      return await importOciLayout(out, { cacheDir: b.cacheDir, limits: b.ociLimits, onMessage: said, onLayer: b.onLayer });
    } finally {
      clearInterval(ticker);
    }
  } catch (err) {
    // A build killed by its timeout fails for that reason, whatever the killed builder said on its way out.
    guard.check();
    const e = err as Error;
    if (hiddenIn(e.message, b)) throw importError(mask(e.message, secretValues(b)));
    throw err;
  } finally {
    guard.stop();
    await sandbox?.close();
    await b.beforeCleanup?.(scratch).catch(() => {});
    await removeScratch(scratch);
  }
}

/**
 * Scratch dirs and sandboxes of builds whose Kiln died (kill -9): their processes are killed, their namespaces,
 * egress rules and cgroups removed, then the dirs (builder storage, secret files). Run at start and before each build.
 */
export async function sweepDockerfileBuilds(scratchParent: string, egress?: Egress): Promise<number> {
  const dead = await sweepSandboxes(scratchParent, egress ?? (defaultEgress ??= createEgress()));
  for (const name of dead) await removeScratch(join(scratchParent, name));
  return dead.length;
}

/** The addresses (TCP ports) of the registries the operator listed: the builder may reach them in any range. */
async function registryAddresses(registries: string[]): Promise<{ address: string; port: number }[]> {
  const out: { address: string; port: number }[] = [];
  for (const r of registries) {
    const m = /^(.*?)(?::(\d+))?$/.exec(r)!;
    const ports = m[2] ? [Number(m[2])] : [80, 443];
    const found = await lookup(m[1], { all: true }).catch(() => []);
    for (const a of found) for (const port of ports) out.push({ address: a.address, port });
  }
  return out;
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
  // Directories 0755 whatever Kiln's umask: a RUN step's bind mount of the context is made from inside the build's
  // user namespace, which must traverse them.
  const dirs = new Set<string>([dir]);
  await mkdir(dir, { recursive: true });
  for (const f of files) {
    const rel = f.path.replace(/^\.?\/+/, "");
    if (!rel || isAbsolute(rel) || rel.split("/").includes("..")) throw new KilnError("invalid_request", `context path ${JSON.stringify(f.path)} must stay inside the context`);
    const dest = join(dir, rel);
    for (let d = join(dest, ".."); d.startsWith(dir) && !dirs.has(d); d = join(d, "..")) dirs.add(d);
    await mkdir(join(dest, ".."), { recursive: true });
    await copyFile(f.blobPath, dest);
    const mode = typeof f.mode === "string" ? parseInt(f.mode, 8) : f.mode;
    await chmod(dest, Number.isInteger(mode) ? mode! & 0o7777 : 0o644);
  }
  for (const d of dirs) await chmod(d, 0o755);
  return dir;
}

/** Docker Hub's credentials live under docker.io in containers' auth files. */
function authKey(registry: string): string {
  return sameRegistry(registry, "docker.io") ? "docker.io" : registry.replace(/^https?:\/\//, "").replace(/\/.*$/, "");
}

async function buildWithBuildah(
  b: DockerfileBuild,
  contextDir: string,
  scratch: string,
  dockerfile: string,
  secretArgs: string[],
  authFile: string,
  out: string,
  onLine: (l: string) => void,
  sandbox: Sandbox,
  guard: Guard,
) {
  // The storage's id mapping is the builds' own range: every image layer — pulled, or a Kiln template committed
  // here — is laid out for it, and RUN steps are root only inside the build's user namespace.
  const buildMap = `0:${BUILD_HOST_ID_BASE}:${BUILD_ID_RANGE}`;
  const store = ["--root", join(scratch, "root"), "--runroot", join(scratch, "runroot"), "--storage-driver", "vfs"];
  const mapped = [...store, "--userns-uid-map", buildMap, "--userns-gid-map", buildMap];
  await mkdir(join(scratch, "tmp"));
  await chmod(join(scratch, "tmp"), 0o711);
  const conf = join(scratch, "registries.conf");
  const insecure = (b.insecureRegistries ?? []).map((h) => `[[registry]]\nlocation = ${JSON.stringify(h)}\ninsecure = true\n`).join("\n");
  await writeFile(conf, `unqualified-search-registries = ["docker.io"]\nshort-name-mode = "permissive"\n\n${insecure}`);
  // Only what the builder needs, plus the build args (read by `--build-arg NAME`): nothing of Kiln's own environment.
  const env: NodeJS.ProcessEnv = {
    ...(b.buildArgs ?? {}),
    PATH: process.env.PATH ?? "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    HOME: join(scratch, "tmp"),
    TMPDIR: join(scratch, "tmp"),
    CONTAINERS_REGISTRIES_CONF: conf,
    REGISTRY_AUTH_FILE: authFile,
  };
  const opts = { env, onLine, sandbox, signal: b.signal, backpressure: b.logBackpressure, guard };
  const buildah = (args: string[], o: Partial<RunOptions> = {}) => run("buildah", [...mapped, ...args], { ...opts, ...o });

  for (const f of externalFroms(dockerfileImages(readFileSync(dockerfile, "utf8")))) {
    const layers = f.image.includes("$") ? undefined : await b.resolveTemplate?.(f.image);
    if (layers) await importTemplate((args, o) => run("buildah", [...store, ...args], { ...opts, ...o }), buildah, scratch, f.image, layers, onLine);
  }
  const args = ["bud", "--isolation", "oci", "--runtime", sandbox.runtime, ...sandbox.budArgs, "--cgroupns", "private", "--layers=false", "--omit-history", "--authfile", authFile, "-f", dockerfile, "-t", OUTPUT_TAG];
  for (const name of Object.keys(b.buildArgs ?? {})) args.push("--build-arg", name);
  if (b.target) args.push("--target", b.target);
  args.push(...secretArgs, contextDir);
  await buildah(args);
  // Uncompressed layers: the importer reads them straight off the disk, and nothing goes over a network.
  await buildah(["push", "--disable-compression", "--quiet", OUTPUT_TAG, `oci:${out}:latest`]);
}

type Buildah = (args: string[], o?: Partial<RunOptions>) => Promise<string>;

/**
 * A Kiln template named by FROM, given to Buildah as a local image of that name: its stacked layers (read through
 * a read-only overlay mount, so whiteouts apply) copied into a scratch container mapped like the template's layers
 * (host 100000 = 0), and committed into the build-range storage as `localhost/<name>`, which Buildah finds before
 * looking at any registry. The commit shifts every owner into the build's range, keeping setuid bits and file caps.
 */
async function importTemplate(unmapped: Buildah, mapped: Buildah, scratch: string, name: string, layers: SourceLayers, onLine: (l: string) => void) {
  onLine(`FROM ${name}: Kiln template (${layers.layers.length} layers), copied into the builder's storage`);
  // The copy and commit take a while for a large template: a progress line every 10 s says the build is alive.
  const t0 = Date.now();
  const ticker = setInterval(() => onLine(`FROM ${name}: still preparing the template for the builder (${Math.round((Date.now() - t0) / 1000)} s)`), 10_000);
  try {
    await copyTemplate(unmapped, mapped, scratch, name, layers, onLine);
  } finally {
    clearInterval(ticker);
  }
  onLine(`FROM ${name}: ready in the builder's storage after ${((Date.now() - t0) / 1000).toFixed(1)} s`);
}

async function copyTemplate(unmapped: Buildah, mapped: Buildah, scratch: string, name: string, layers: SourceLayers, onLine: (l: string) => void) {
  const templateMap = `0:${HOST_ID_BASE}:${ID_RANGE}`;
  const quiet = { onLine: () => {}, keepStdout: true };
  const ctr = (await unmapped(["from", "--quiet", "--userns-uid-map", templateMap, "--userns-gid-map", templateMap, "scratch"], quiet)).trim();
  const mnt = (await unmapped(["mount", ctr], quiet)).trim();
  // cp -a into anything but the container's own root would write the host: refuse what Buildah did not make.
  if (!isAbsolute(mnt) || relative(join(scratch, "root"), mnt).startsWith("..") || !existsSync(mnt)) throw importError(`the builder mounted the template container at an unexpected path: ${mnt}`);
  const merged = join(scratch, "template-view");
  const empty = join(scratch, "template-empty");
  await mkdir(merged);
  await mkdir(empty);
  const lower = [...layers.layers.map((l) => l.dir), empty].reverse().join(":");
  await run("mount", ["-t", "overlay", "overlay", "-o", `ro,lowerdir=${lower}`, merged], { env: process.env, onLine: () => {} });
  try {
    await run("cp", ["-a", `${merged}/.`, `${mnt}/`], { env: process.env, onLine });
  } finally {
    await run("umount", [merged], { env: process.env, onLine: () => {} });
  }
  await unmapped(["umount", ctr], quiet);
  // The template's image config goes with it: a Dockerfile on top inherits its env, working dir and user.
  const cfg = layers.config;
  const configArgs = Object.entries(cfg.env).flatMap(([k, v]) => ["--env", `${k}=${v}`]);
  if (cfg.workingDir) configArgs.push("--workingdir", cfg.workingDir);
  if (cfg.user) configArgs.push("--user", cfg.user);
  if (configArgs.length) await unmapped(["config", ...configArgs, ctr], quiet);
  const ref = parseReference(name);
  const local = `localhost/${name.replace(/:[^/:]*$/, "")}:${ref.tag ?? "latest"}`;
  await mapped(["commit", "--quiet", "--format", "oci", ctr, local], quiet);
  await unmapped(["rm", ctr], quiet);
}

async function buildWithBuildctl(b: DockerfileBuild, contextDir: string, scratch: string, secretArgs: string[], out: string, onLine: (l: string) => void, guard: Guard) {
  const tar = join(scratch, "image.tar");
  const args = ["--addr", b.buildkitHost!, "build", "--progress", "plain", "--frontend", "dockerfile.v0", "--local", `context=${contextDir}`, "--local", `dockerfile=${scratch}`, "--opt", "filename=Dockerfile"];
  // buildctl has no way to read build args but its command line (`--opt build-arg:K=V`); they go there, and the
  // docs say so: BUILDKIT_HOST is the operator's own daemon, whose settings decide RUN steps' isolation.
  for (const [k, v] of Object.entries(b.buildArgs ?? {})) args.push("--opt", `build-arg:${k}=${v}`);
  if (b.target) args.push("--opt", `target=${b.target}`);
  args.push(...secretArgs, "--output", `type=oci,dest=${tar},compression=uncompressed`);
  // buildctl reads registry credentials from $DOCKER_CONFIG/config.json: the auth file written for this build.
  await run("buildctl", args, { env: { ...process.env, DOCKER_CONFIG: join(scratch, "auth") }, onLine, signal: b.signal, backpressure: b.logBackpressure, guard });
  await mkdir(out);
  await run("tar", ["-xf", tar, "-C", out], { env: process.env, onLine });
  await rm(tar, { force: true });
}

/** The builders' view of the scratch dirs: traversable by the build's ids whatever the data dir's mode is. */
const EXPOSED = "/run/kiln-builds";

/** Binds the scratch dir at /run/kiln-builds/<name> (private: mounts the builder makes there stay there). */
async function exposeScratch(scratch: string): Promise<string> {
  await mkdir(EXPOSED, { recursive: true, mode: 0o711 });
  await chmod(EXPOSED, 0o711);
  const at = join(EXPOSED, basename(scratch));
  await mkdir(at, { mode: 0o711 });
  await run("mount", ["--bind", scratch, at], { env: process.env, onLine: () => {} });
  await run("mount", ["--make-private", at], { env: process.env, onLine: () => {} });
  return at;
}

/** Unmounts anything left mounted below the scratch dir or its exposed view (a killed RUN), then removes both. */
async function removeScratch(scratch: string) {
  const exposed = join(EXPOSED, basename(scratch));
  const mounts = readFileSync("/proc/self/mounts", "utf8")
    .split("\n")
    .map((l) => l.split(" ")[1]?.replace(/\\040/g, " "))
    .filter((m): m is string => !!m && [scratch, exposed].some((d) => m === d || m.startsWith(`${d}/`)))
    .sort((a, b) => b.length - a.length);
  for (const m of mounts) await run("umount", ["-l", m], { env: process.env, onLine: () => {} }).catch(() => {});
  await rmdir(exposed).catch(() => {});
  await rm(scratch, { recursive: true, force: true });
}
