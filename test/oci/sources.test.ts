// The two build sources as the pipeline calls them: `oci_import` (progress and layer counters into the build
// log) and `dockerfile` (uploaded context blobs laid out for the builder, an input digest free of secrets).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createOciImportSource } from "../../src/builder/sources/oci-import.ts";
import { createDockerfileSource, dockerfileSourceDigest } from "../../src/builder/sources/dockerfile.ts";
import type { DockerfileRequest } from "../../src/builder/sources/dockerfile.ts";
import type { ImportLogEntry } from "../../src/builder/oci/events.ts";
import { readFromStack } from "../../src/builder/oci/stack.ts";
import { pushImage, registryAvailable, startRegistry } from "../support/oci-registry.ts";
import type { TestRegistry } from "../support/oci-registry.ts";
import { hostArchSupported, shellRootfs } from "../support/mini-rootfs.ts";

const skip = registryAvailable() ?? (!hostArchSupported() ? "x86-64 only" : spawnSync("buildah", ["--version"]).status !== 0 ? "buildah is not installed" : undefined);
const opt = { skip };
let reg: TestRegistry;
let dir: string;

before(async () => {
  if (skip) return;
  reg = await startRegistry();
  dir = await mkdtemp(join(tmpdir(), "kiln-oci-sources-"));
  // `etc/` is listed as real images list every directory: Debian's Buildah lays a directory a layer only implies out
  // as host root, where a RUN step (root only in the build's user namespace) cannot make its /etc/hosts mount point.
  await pushImage(reg, "mini/shell", "v1", { layers: [{ entries: shellRootfs() }, { entries: [{ name: "etc/", type: "directory" }, { name: "etc/motd", content: "hi\n" }] }] });
});

after(async () => {
  if (skip) return;
  await reg.stop();
  await rm(dir, { recursive: true, force: true });
});

test("oci_import: layers and config with the manifest digest; layer cache entries and counters go to the build log", opt, async () => {
  const ociImport = createOciImportSource({ ociDir: join(dir, "cache", "oci"), insecureRegistries: [reg.host] });
  const run = async () => {
    const entries: ImportLogEntry[] = [];
    const counters: string[] = [];
    const src = await ociImport(`${reg.host}/mini/shell:v1`, { signal: new AbortController().signal, log: (e) => entries.push(e), count: (c) => counters.push(c) });
    return { src, entries, counters };
  };
  const cold = await run();
  assert.match(cold.src.digest, /^sha256:[0-9a-f]{64}$/);
  assert.equal(cold.src.layers.length, 3);
  assert.deepEqual(cold.counters.filter((c) => c !== "layer_stores").sort(), ["layer_misses", "layer_misses"]);
  assert.ok(cold.entries.some((e) => e.kind === "message" && /layer 2\/2/.test(e.message)));
  const warm = await run();
  assert.deepEqual(warm.counters, ["layer_hits", "layer_hits"]);
  assert.deepEqual(warm.entries.filter((e) => e.kind === "cache").map((e) => e.cache_outcome), ["hit", "hit"]);
  assert.equal(warm.src.digest, cold.src.digest);
});

test("dockerfile: context blobs laid out for the builder, dockerfile_path among them, a digest without secret values", opt, async () => {
  const blob = async (content: string) => {
    const sha = createHash("sha256").update(content).digest("hex");
    const p = join(dir, sha);
    await writeFile(p, content);
    return { sha256: sha, blobPath: p };
  };
  const secret = `v-${randomBytes(8).toString("hex")}`;
  const req: DockerfileRequest = {
    dockerfilePath: "build/Dockerfile",
    target: "out",
    secrets: [{ id: "k", value: secret }],
    contextFiles: [
      { path: "build/Dockerfile", ...(await blob(`FROM ${reg.host}/mini/shell:v1 AS out\nCOPY tool.sh /usr/local/bin/tool\nRUN cat /etc/motd > /seen\n`)) },
      { path: "tool.sh", mode: "0755", ...(await blob("#!/bin/sh\necho tool\n")) },
    ],
  };
  const source = createDockerfileSource({ cacheDir: join(dir, "cache"), dataDir: join(dir, "data"), insecureRegistries: [reg.host] });
  source.validate(req);
  const lines: string[] = [];
  const out = await source.build(req, { signal: new AbortController().signal, log: (e) => lines.push(e.message), count: () => {} });
  const dirs = out.layers.map((l) => l.dir);
  assert.equal((await readFromStack(dirs, "/seen"))?.toString(), "hi\n");
  assert.equal((await readFromStack(dirs, "/usr/local/bin/tool"))?.toString(), "#!/bin/sh\necho tool\n");
  assert.equal(out.digest, dockerfileSourceDigest(req));
  assert.notEqual(dockerfileSourceDigest({ ...req, target: undefined }), out.digest, "the target is part of the input");
  assert.equal(dockerfileSourceDigest({ ...req, secrets: [{ id: "k", value: "other" }] }), out.digest, "a secret's value is not");
  assert.ok(!lines.join("\n").includes(secret));
  assert.throws(() => source.validate({ ...req, dockerfilePath: "nope/Dockerfile" }), /not a file in the build context/);
});
