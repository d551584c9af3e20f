// Dockerfile builds on the `buildkit` backend (Buildah here: no BUILDKIT_HOST), their output imported as layers:
// secret mounts, build args, a target stage, COPY from the context, FROM a Kiln template, registry credentials,
// SPEC.md's rules for authenticated builds, and no secret left in the data dir, the builder's storage or the log.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { existsSync, readdirSync, statSync } from "node:fs";
import { chmod, mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { buildDockerfile, validateDockerfileBuild } from "../../src/builder/backends/buildkit.ts";
import type { DockerfileBuild } from "../../src/builder/backends/buildkit.ts";
import { importImage } from "../../src/builder/oci/import.ts";
import { readFromStack } from "../../src/builder/oci/stack.ts";
import { pushImage, registryAvailable, startRegistry } from "../support/oci-registry.ts";
import type { TestRegistry } from "../support/oci-registry.ts";
import { hostArchSupported, shellRootfs } from "../support/mini-rootfs.ts";

function skipReason(): string | undefined {
  const r = registryAvailable();
  if (r) return r;
  if (!hostArchSupported()) return "the mini rootfs is copied from an x86-64 host";
  if (spawnSync("buildah", ["--version"]).status !== 0) return "buildah is not installed (scripts/up.sh installs it)";
  return undefined;
}
const skip = skipReason();
const opt = { skip };
const secret = `sekrit-${randomBytes(12).toString("hex")}`;
const password = `regpw-${randomBytes(12).toString("hex")}`;
let reg: TestRegistry;
let priv: TestRegistry;
let dir: string;
const lines: string[] = [];

before(async () => {
  if (skip) return;
  [reg, priv] = await Promise.all([startRegistry(), startRegistry({ auth: { username: "builder", password } })]);
  dir = await mkdtemp(join(tmpdir(), "kiln-oci-dockerfile-"));
  await chmod(dir, 0o700); // private, as a data dir is: the builder works through its own traversable view
  await pushImage(reg, "mini/shell", "v1", { layers: [{ entries: shellRootfs() }] });
  await pushImage(priv, "mini/private", "v1", { layers: [{ entries: shellRootfs() }, { entries: [{ name: "private-marker", content: "p" }] }] });
});

after(async () => {
  if (skip) return;
  await Promise.all([reg.stop(), priv.stop()]);
  await rm(dir, { recursive: true, force: true });
});

async function context(files: Record<string, string>): Promise<string> {
  const ctx = await mkdtemp(join(dir, "ctx-"));
  for (const [p, content] of Object.entries(files)) {
    await mkdir(join(ctx, p, ".."), { recursive: true });
    await writeFile(join(ctx, p), content);
  }
  return ctx;
}

const base = (over: Partial<DockerfileBuild> & { contextDir: string }): DockerfileBuild => ({
  cacheDir: join(dir, "cache"),
  scratchParent: join(dir, "data", "builder"),
  insecureRegistries: [reg.host, priv.host],
  onMessage: (l) => lines.push(l),
  ...over,
});

/** Files under `root` whose bytes contain `needle` (grep -r over everything, binary files included). */
function holding(root: string, needle: string): string[] {
  if (!existsSync(root)) return [];
  const r = spawnSync("grep", ["-rlaF", "--", needle, root]);
  return r.stdout.toString().split("\n").filter(Boolean);
}

test("a Dockerfile build: secret mount, build args, target stage and COPY from the context, imported as layers", opt, async () => {
  const ctx = await context({
    "app.txt": "from the context\n",
    "docker/Dockerfile.app": [
      `FROM ${reg.host}/mini/shell:v1 AS base`,
      "ARG GREETING=unset",
      'RUN echo "$GREETING" > /greeting; cat /proc/self/uid_map > /uid_map',
      "COPY app.txt /app.txt",
      "RUN --mount=type=secret,id=token read s < /run/secrets/token; echo ${#s} > /secret-len",
      "FROM base AS final",
      "RUN echo final > /final",
      "FROM base AS other",
      "RUN echo other > /other",
      "",
    ].join("\n"),
  });
  let storageHits: string[] = ["(not searched)"];
  const img = await buildDockerfile(
    base({
      contextDir: ctx,
      dockerfilePath: "docker/Dockerfile.app",
      buildArgs: { GREETING: "hello-arg" },
      target: "final",
      secrets: [{ id: "token", value: secret }],
      beforeCleanup: async (scratch) => {
        // The builder's storage, its temp files and the output: everything but the secret file Kiln handed it.
        storageHits = ["root", "runroot", "tmp", "out"].flatMap((d) => holding(join(scratch, d), secret));
      },
    }),
  );
  const dirs = img.layers.map((l) => l.dir);
  assert.equal((await readFromStack(dirs, "/greeting"))?.toString(), "hello-arg\n");
  const holder = dirs.findLast((d) => existsSync(join(d, "greeting")))!;
  assert.equal(statSync(join(holder, "greeting")).uid, 100_000, "a file RUN wrote as build root is machine root (host 100000), shifted once");
  assert.deepEqual((await readFromStack(dirs, "/uid_map"))?.toString().trim().split(/\s+/), ["0", "1000000000", "65536"], "RUN steps are root only inside a user namespace, on the builds' own host ids (no machine has them)");
  assert.equal((await readFromStack(dirs, "/app.txt"))?.toString(), "from the context\n");
  assert.equal((await readFromStack(dirs, "/final"))?.toString(), "final\n");
  assert.equal(await readFromStack(dirs, "/other"), undefined, "the stage after the target is not built");
  assert.equal((await readFromStack(dirs, "/secret-len"))?.toString().trim(), String(secret.length), "the secret was readable by RUN");
  assert.deepEqual(storageHits, [], "the secret is in none of the builder's storage");
  assert.deepEqual(holding(dir, secret), [], "nor anywhere under the data dir, the layer cache or the context");
  assert.ok(!lines.join("\n").includes(secret), "nor in the builder's output");
  assert.ok(lines.some((l) => /STEP|COMMIT/.test(l)), "the builder's output is streamed");
  assert.deepEqual(readdirSync(join(dir, "data", "builder")), [], "the builder's scratch storage is removed after the build");
});

test("FROM a Kiln template builds on the template's layers", opt, async () => {
  const template = await importImage(`${reg.host}/mini/shell:v1`, { cacheDir: join(dir, "cache"), insecureRegistries: [reg.host] });
  const asked: string[] = [];
  const ctx = await context({ Dockerfile: "FROM local/mini\nRUN cat /etc/motd > /copied\n" });
  const motdLayer = await importImage(`${reg.host}/mini/shell:v1`, { cacheDir: join(dir, "cache"), insecureRegistries: [reg.host] });
  assert.deepEqual(motdLayer.layers, template.layers);
  const withMotd = { ...template, layers: [...template.layers] };
  const extra = join(dir, "motd-layer");
  await mkdir(join(extra, "etc"), { recursive: true });
  await writeFile(join(extra, "etc", "motd"), "template motd\n");
  execFileSync("chown", ["-R", "100000:100000", extra]);
  withMotd.layers.push({ dir: extra, digest: "sha256:motd" });
  const img = await buildDockerfile(base({ contextDir: ctx, resolveTemplate: async (name) => (asked.push(name), name === "local/mini" ? withMotd : undefined) }));
  assert.deepEqual(asked, ["local/mini"]);
  const dirs = img.layers.map((l) => l.dir);
  assert.equal((await readFromStack(dirs, "/copied"))?.toString(), "template motd\n");
  assert.ok(await readFromStack(dirs, "/bin/cat"), "the template's files are in the image");
});

test("registry_credentials let the builder pull a private base image; the password is stored nowhere", opt, async () => {
  const ctx = await context({ Dockerfile: `FROM ${priv.host}/mini/private:v1\nRUN echo ok > /ok\n` });
  const img = await buildDockerfile(base({ contextDir: ctx, registryCredentials: [{ registry: priv.host, username: "builder", password }] }));
  const dirs = img.layers.map((l) => l.dir);
  assert.ok(await readFromStack(dirs, "/private-marker"));
  assert.equal((await readFromStack(dirs, "/ok"))?.toString(), "ok\n");
  assert.deepEqual(holding(dir, password), []);
  assert.ok(!lines.join("\n").includes(password));
  const denied = await buildDockerfile(base({ contextDir: ctx })).then(() => undefined, (e: Error) => e);
  assert.ok(denied && !denied.message.includes(password), "without credentials the pull fails");
});

test("bad Dockerfile requests are invalid before any build: credentials for unused registries, authenticated builds SPEC.md rejects, paths outside the context", opt, async () => {
  const invalid = (b: Parameters<typeof validateDockerfileBuild>[0], pattern: RegExp) =>
    assert.throws(() => validateDockerfileBuild(b), (e: Error & { code?: string }) => e.code === "invalid_request" && pattern.test(e.message));
  const ctx = await context({ Dockerfile: "FROM alpine\n" });
  invalid({ contextDir: ctx, registryCredentials: [{ registry: "ghcr.io", username: "u", password: "p" }] }, /ghcr\.io.*does not pull from.*registry-1\.docker\.io/);
  validateDockerfileBuild({ contextDir: ctx, registryCredentials: [{ registry: "docker.io", username: "u", password: "p" }] });
  const auth = { type: "basic" as const, username: "u", password: "p" };
  invalid({ contextDir: ctx, dockerfile: "ARG IMG=alpine\nFROM $IMG\n", baseImageAuth: auth }, /variable-based FROM \(line 2/);
  invalid({ contextDir: ctx, dockerfile: "FROM alpine\nCOPY --from=ghcr.io/x/tools:1 /bin/t /t\n", baseImageAuth: auth }, /imported as a stage by --from/);
  invalid({ contextDir: ctx, dockerfile: "FROM ghcr.io/a/b AS one\nFROM quay.io/c/d\nCOPY --from=one /x /x\n", baseImageAuth: auth }, /one registry, but the Dockerfile pulls from ghcr\.io, quay\.io/);
  validateDockerfileBuild({ contextDir: ctx, dockerfile: "FROM ghcr.io/a/b AS one\nFROM one\nCOPY --from=one /x /x\n", baseImageAuth: auth });
  invalid({ contextDir: ctx, dockerfilePath: "../Dockerfile" }, /inside the build context/);
  invalid({ contextDir: ctx, dockerfilePath: "missing/Dockerfile" }, /not a file in the build context/);
  invalid({ contextDir: ctx, secrets: [{ id: "a b", value: "v" }] }, /secret id/);
});

test("a failing RUN is a build_error with the builder's last lines; a secret a RUN prints is masked", opt, async () => {
  const ctx = await context({ Dockerfile: `FROM ${reg.host}/mini/shell:v1\nRUN --mount=type=secret,id=s cat /run/secrets/s; exit 3\n` });
  const seen: string[] = [];
  const err = await buildDockerfile(base({ contextDir: ctx, secrets: [{ id: "s", value: secret }], onMessage: (l) => seen.push(l) })).then(() => undefined, (e: Error & { detail?: { code?: string } }) => e);
  assert.ok(err, "the build fails");
  assert.equal(err.detail?.code, "build_error");
  assert.match(err.message, /Dockerfile build failed/);
  assert.ok(!err.message.includes(secret) && !seen.join("\n").includes(secret), "the printed secret is masked");
  assert.ok(seen.some((l) => l.includes("[secret]")), "the line that printed it shows a mask");
  assert.deepEqual(readdirSync(join(dir, "data", "builder")), [], "a failed build leaves no storage behind");
});

test("a build's scratch dir left by a killed Kiln (builder storage, secret files) is removed by the next build", opt, async () => {
  const dead = spawnSync("true").pid!;
  const parent = join(dir, "data", "builder");
  const stale = join(parent, `bld-${dead}-abc123`);
  await mkdir(join(stale, "secrets"), { recursive: true });
  await writeFile(join(stale, "secrets", "0"), secret);
  const ctx = await context({ Dockerfile: `FROM ${reg.host}/mini/shell:v1\nRUN echo again > /again\n` });
  await buildDockerfile(base({ contextDir: ctx }));
  assert.ok(!existsSync(stale), "the abandoned scratch dir is gone");
  assert.deepEqual(holding(dir, secret), [], "and with it the secret file");
});
