// The importer's pure parts: image references, auth challenges and credentials, platform choice, User forms,
// the Dockerfile's FROM operands, and how an import's progress becomes build log entries.

import { test } from "node:test";
import assert from "node:assert/strict";
import { parseReference } from "../../src/builder/oci/reference.ts";
import { credentialFor, parseChallenge } from "../../src/builder/oci/auth.ts";
import { selectPlatform } from "../../src/builder/oci/platform.ts";
import { entryPath, namespacedCapability, xattrsToKeep } from "../../src/builder/oci/unpack.ts";
import { checkDigest } from "../../src/builder/oci/types.ts";
import { resolveUser } from "../../src/builder/oci/image-config.ts";
import { accountFiles } from "../../src/builder/oci/stack.ts";
import { importLogEvents } from "../../src/builder/oci/events.ts";
import type { ImportLogEntry } from "../../src/builder/oci/events.ts";
import { dockerfileImages, externalFroms } from "../../src/builder/backends/dockerfile-images.ts";

test("Docker Hub short names are normalised; registries, tags and digests are parsed", () => {
  assert.deepEqual(parseReference("python"), { registry: "registry-1.docker.io", repository: "library/python", tag: "latest", digest: undefined });
  assert.deepEqual(parseReference("python:3.12-slim"), { registry: "registry-1.docker.io", repository: "library/python", tag: "3.12-slim", digest: undefined });
  assert.deepEqual(parseReference("docker.io/user/app:v1"), { registry: "registry-1.docker.io", repository: "user/app", tag: "v1", digest: undefined });
  assert.deepEqual(parseReference("127.0.0.1:5000/a/b"), { registry: "127.0.0.1:5000", repository: "a/b", tag: "latest", digest: undefined });
  assert.deepEqual(parseReference("localhost/app"), { registry: "localhost", repository: "app", tag: "latest", digest: undefined });
  const d = `sha256:${"a".repeat(64)}`;
  assert.deepEqual(parseReference(`ghcr.io/o/r:1@${d}`), { registry: "ghcr.io", repository: "o/r", tag: "1", digest: d });
  for (const bad of ["", "UPPER/case", "a@sha256:short", "a:b:c/d", "x:" + "t".repeat(200)]) assert.throws(() => parseReference(bad), /not valid|invalid|digest/, bad);
});

test("a WWW-Authenticate challenge is parsed; docker config credentials are found by host", () => {
  assert.deepEqual(parseChallenge('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/python:pull"'), {
    scheme: "bearer",
    params: { realm: "https://auth.docker.io/token", service: "registry.docker.io", scope: "repository:library/python:pull" },
  });
  assert.equal(parseChallenge('Basic realm="x"')?.scheme, "basic");
  const config = { auths: { "https://index.docker.io/v1/": { auth: Buffer.from("u:p:w").toString("base64") }, "ghcr.io": { registrytoken: "t" } } };
  assert.deepEqual(credentialFor({ type: "docker_config", config }, "registry-1.docker.io"), { kind: "basic", username: "u", password: "p:w" });
  assert.deepEqual(credentialFor({ type: "docker_config", config }, "ghcr.io"), { kind: "bearer", token: "t" });
  assert.equal(credentialFor({ type: "docker_config", config }, "quay.io"), undefined);
  assert.throws(() => credentialFor({ type: "docker_config", config: "{not json" }, "x"), (e: Error) => !e.message.includes("{not json"));
});

test("platform choice: exact variant, then variantless; os requirements and missing platforms are errors", () => {
  const m = (digest: string, platform: Record<string, unknown>) => ({ digest, platform });
  assert.equal(selectPlatform([m("a", { os: "linux", architecture: "arm64" }), m("b", { os: "linux", architecture: "arm64", variant: "v8" })], "arm64").digest, "b");
  assert.equal(selectPlatform([m("a", { os: "linux", architecture: "arm64", variant: "v8.0" })], "arm64").digest, "a");
  assert.equal(selectPlatform([m("a", { os: "linux", architecture: "amd64", variant: "v2" }), m("b", { os: "linux", architecture: "amd64" })], "amd64").digest, "b");
  assert.throws(() => selectPlatform([m("a", { os: "linux", architecture: "amd64", "os.features": ["x"] })], "amd64"), /manifest a .*os\.features/);
  assert.throws(() => selectPlatform([m("a", { os: "linux", architecture: "amd64", variant: "v3" })], "amd64"), /no manifest for linux\/amd64/);
});

test("Kiln's top layer adds root and unlisted image users to passwd, keeping the image's own lines", () => {
  assert.deepEqual(accountFiles(undefined, undefined), { passwd: "root:x:0:0:root:/root:/bin/sh\n", group: "root:x:0:\n", userName: "root" });
  assert.deepEqual(accountFiles("root:x:0:0::/root:/bin/sh\n", "root:x:0:\n"), { passwd: undefined, group: undefined, userName: "root" });
  assert.deepEqual(accountFiles("app:x:5:5::/:/bin/sh", "g:x:5:\n", { uid: 7, gid: 8 }), {
    passwd: "root:x:0:0:root:/root:/bin/sh\napp:x:5:5::/:/bin/sh\nu7:x:7:8::/:/bin/sh\n",
    group: undefined,
    userName: "u7",
  });
});

test("layer entry paths stay inside the root", () => {
  assert.equal(entryPath("./a/./b/"), "a/b");
  assert.equal(entryPath("/etc/passwd"), "etc/passwd");
  assert.equal(entryPath("a/../b"), "b");
  assert.throws(() => entryPath("a/../../b"), /escapes/);
});

test("User resolution: names must exist; numeric ids need not", () => {
  const passwd = "app:x:10:20::/:/bin/sh\n";
  const group = "grp:x:30:\n";
  assert.deepEqual(resolveUser("app", passwd, group), { uid: 10, gid: 20 });
  assert.deepEqual(resolveUser("5", passwd, group), { uid: 5, gid: 0 });
  assert.deepEqual(resolveUser("5:grp", passwd, group), { uid: 5, gid: 30 });
  assert.throws(() => resolveUser("app:x:y", passwd, group), /user\[:group\]/);
  assert.throws(() => resolveUser("70000", passwd, group), /id range/);
});

test("a Dockerfile's FROM operands and --from images are read without interpreting anything else", () => {
  const text = "# c\nARG V=1\nFROM --platform=linux/amd64 ghcr.io/a/b:1 AS Build\nRUN --mount=type=cache,from=quay.io/x/y,target=/c \\\n  make\nFROM build\nCOPY --from=build /o /o\nCOPY --from=0 /o /p\nFROM scratch\n";
  const images = dockerfileImages(text);
  assert.deepEqual(images.froms.map((f) => [f.image, f.alias]), [["ghcr.io/a/b:1", "build"], ["build", undefined], ["scratch", undefined]]);
  assert.deepEqual(images.implicit.map((i) => i.image), ["quay.io/x/y"]);
  assert.deepEqual(externalFroms(images).map((f) => f.image), ["ghcr.io/a/b:1"]);
});

test("import progress becomes message entries and layer cache entries with counters", () => {
  const entries: ImportLogEntry[] = [];
  const counters: string[] = [];
  const ev = importLogEvents((e) => entries.push(e), (c) => counters.push(c));
  ev.onMessage("downloaded 1.0 MB of 2.0 MB (layers 0/2)");
  ev.onLayer({ digest: "sha256:aa", outcome: "miss", bytes: 1 });
  ev.onLayer({ digest: "sha256:aa", outcome: "stored", bytes: 1 });
  ev.onLayer({ digest: "sha256:bb", outcome: "hit", bytes: 1 });
  assert.deepEqual(counters, ["layer_misses", "layer_stores", "layer_hits"]);
  assert.deepEqual(entries.map((e) => [e.kind, e.cache_outcome]), [["message", undefined], ["cache", "miss"], ["cache", "stored"], ["cache", "hit"]]);
  assert.equal(entries[1].cache_reason, "missing_or_incompatible");
});

test("xattrs from a layer: user.* kept, security.capability rewritten as v3 rooted at machine root, the rest dropped", () => {
  const v2 = Buffer.alloc(20);
  v2.writeUInt32LE(0x02000001, 0);
  v2.writeUInt32LE(1 << 13, 4);
  const v3 = namespacedCapability(v2)!;
  assert.equal(v3.length, 24);
  assert.equal(v3.readUInt32LE(0), 0x03000001, "v3, effective flag kept");
  assert.equal(v3.readUInt32LE(4), 1 << 13, "the same capabilities");
  assert.equal(v3.readUInt32LE(20), 100000, "rooted at host uid 100000");
  const rooted = Buffer.concat([Buffer.from(v3.subarray(0, 20)), Buffer.alloc(4)]);
  rooted.writeUInt32LE(0x03000000, 0);
  assert.equal(namespacedCapability(rooted)?.readUInt32LE(20), 100000, "a v3 rooted at the image's root is re-rooted");
  rooted.writeUInt32LE(1000, 20);
  assert.equal(namespacedCapability(rooted), undefined, "a v3 rooted elsewhere is dropped");
  assert.equal(namespacedCapability(Buffer.alloc(12)), undefined, "v1 and malformed values are dropped");
  const kept = xattrsToKeep({
    "SCHILY.xattr.user.a": "1",
    "SCHILY.xattr.user.bad name": "x",
    "SCHILY.xattr.trusted.overlay.opaque": "y",
    "SCHILY.xattr.security.selinux": "system_u:object_r:shadow_t:s0",
    "SCHILY.xattr.system.posix_acl_access": "x",
    "SCHILY.xattr.security.capability": v2.toString("latin1"),
  });
  assert.deepEqual(kept.map((x) => x.name), ["user.a", "security.capability"]);
});

test("digests are sha256 and 64 lowercase hex digits before any use", () => {
  assert.equal(checkDigest(`sha256:${"a".repeat(64)}`, "x"), `sha256:${"a".repeat(64)}`);
  for (const bad of ["sha256:../../../../srv/x/travcfg", `sha512:${"a".repeat(128)}`, `sha256:${"A".repeat(64)}`, `sha256:${"a".repeat(63)}/`, 42, undefined]) {
    assert.throws(() => checkDigest(bad, "the config"), /the config has a digest Kiln cannot check/);
  }
});
