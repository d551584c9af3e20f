// Importing OCI images from a real registry on loopback (Debian's docker-registry) into layer dirs a machine can
// stack: media types, platform choice, special files, links, whiteouts, User forms, cache reuse.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { existsSync, lstatSync, mkdirSync, readFileSync, readlinkSync, statSync, writeFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { importImage, layerDir } from "../../src/builder/oci/import.ts";
import { readFromStack } from "../../src/builder/oci/stack.ts";
import { HOST_ID_BASE } from "../../src/runtime/oci/idmap.ts";
import { pushImage, pushIndex, registryAvailable, sha256, startRegistry, tarOf } from "../support/oci-registry.ts";
import type { TestRegistry } from "../support/oci-registry.ts";

const skip = registryAvailable();
let reg: TestRegistry;
let cacheDir: string;
const opt = { skip };

before(async () => {
  if (skip) return;
  reg = await startRegistry();
  cacheDir = await mkdtemp(join(tmpdir(), "kiln-oci-cache-"));
});

after(async () => {
  if (skip) return;
  await reg.stop();
  await rm(cacheDir, { recursive: true, force: true });
});

const importOf = (ref: string, extra: { arch?: string; cache?: string } = {}) =>
  importImage(`${reg.host}/${ref}`, { cacheDir: extra.cache ?? cacheDir, insecureRegistries: [reg.host], arch: extra.arch ?? "amd64" });

async function rejection(p: Promise<unknown>): Promise<string> {
  const err = await p.then(() => undefined, (e: Error & { detail?: { code?: string } }) => e);
  assert.ok(err, "the import must fail");
  assert.equal(err.detail?.code, "build_error", `a build_error, got ${err.message}`);
  return err.message;
}

test("tar, gzip and zstd layers are unpacked with ownership shifted, modes (setuid kept) and mtimes", opt, async () => {
  const mtime = new Date("2023-05-06T07:08:09Z");
  await pushImage(reg, "media/all", "v1", {
    layers: [
      { compression: "none", entries: [{ name: "etc/", type: "directory" }, { name: "etc/raw.txt", content: "raw\n" }] },
      { compression: "gzip", entries: [{ name: "usr/bin/su-ish", content: "x", mode: 0o4755, uid: 0, gid: 0, mtime }] },
      { compression: "zstd", entries: [{ name: "home/u/", type: "directory", uid: 1000, gid: 1000, mode: 0o750 }, { name: "home/u/z.txt", content: "zstd\n", uid: 1000, gid: 1000 }] },
    ],
  });
  const messages: string[] = [];
  const outcomes: string[] = [];
  const img = await importImage(`${reg.host}/media/all:v1`, {
    cacheDir,
    insecureRegistries: [reg.host],
    arch: "amd64",
    onMessage: (m) => messages.push(m),
    onLayer: (l) => outcomes.push(l.outcome),
  });
  assert.equal(img.layers.length, 4, "three image layers and Kiln's top layer");
  const [raw, gz, zst] = img.layers.map((l) => l.dir);
  assert.equal(readFileSync(join(raw, "etc/raw.txt"), "utf8"), "raw\n");
  const su = statSync(join(gz, "usr/bin/su-ish"));
  assert.equal(su.mode & 0o7777, 0o4755, "setuid survives the ownership shift");
  assert.equal(su.uid, HOST_ID_BASE);
  assert.equal(su.mtime.toISOString(), mtime.toISOString());
  const home = statSync(join(zst, "home/u"));
  assert.equal(home.uid, HOST_ID_BASE + 1000);
  assert.equal(home.mode & 0o7777, 0o750);
  assert.equal(readFileSync(join(zst, "home/u/z.txt"), "utf8"), "zstd\n");
  for (const l of img.layers.slice(0, 3)) assert.equal(l.dir, layerDir(cacheDir, l.digest), "each layer dir is keyed by its diff id");
  assert.deepEqual([...outcomes].sort(), ["miss", "miss", "miss", "stored", "stored", "stored"], "each layer is a cache miss, then stored");
  assert.ok(messages.some((m) => /layer 3\/3/.test(m)), `progress names layers k/n: ${messages.join(" | ")}`);

  const again: string[] = [];
  const warm = await importImage(`${reg.host}/media/all:v1`, { cacheDir, insecureRegistries: [reg.host], arch: "amd64", onLayer: (l) => again.push(l.outcome) });
  assert.deepEqual(again, ["hit", "hit", "hit"], "a re-import finds every layer in the cache");
  assert.deepEqual(warm.layers, img.layers);
});

test("an index prefers the exact variant for the host architecture, then a variantless linux manifest", opt, async () => {
  const mk = async (marker: string, architecture = "amd64") =>
    pushImage(reg, "multi/app", undefined, { architecture, layers: [{ entries: [{ name: "which", content: marker }] }] });
  const v1 = await mk("amd64-v1");
  const v3 = await mk("amd64-v3");
  const plain = await mk("amd64-plain");
  const arm = await mk("arm64-v8", "arm64");
  const armv7 = await mk("arm-v7", "arm");
  await pushIndex(reg, "multi/app", "all", [
    { ...armv7, platform: { os: "linux", architecture: "arm", variant: "v7" } },
    { ...v3, platform: { os: "linux", architecture: "amd64", variant: "v3" } },
    { ...plain, platform: { os: "linux", architecture: "amd64" } },
    { ...v1, platform: { os: "linux", architecture: "amd64", variant: "v1" } },
    { ...arm, platform: { os: "linux", architecture: "arm64", variant: "v8" } },
  ]);
  const which = async (tag: string, arch: string) => {
    const img = await importOf(`multi/app:${tag}`, { arch });
    return (await readFromStack(img.layers.map((l) => l.dir), "/which"))?.toString();
  };
  assert.equal(await which("all", "amd64"), "amd64-v1");
  assert.equal(await which("all", "arm64"), "arm64-v8");
  await pushIndex(reg, "multi/app", "fallback", [
    { ...v3, platform: { os: "linux", architecture: "amd64", variant: "v3" } },
    { ...plain, platform: { os: "linux", architecture: "amd64" } },
  ]);
  assert.equal(await which("fallback", "amd64"), "amd64-plain");
  await pushIndex(reg, "multi/app", "none", [{ ...v3, platform: { os: "linux", architecture: "amd64", variant: "v3" } }, { ...armv7, platform: { os: "windows", architecture: "amd64" } }]);
  assert.match(await rejection(importOf("multi/app:none")), /no manifest for linux\/amd64.*offers: linux\/amd64\/v3, windows\/amd64/);
});

test("Docker's manifest list and schema 2 manifest are pulled like OCI's", opt, async () => {
  const one = await pushImage(reg, "docker/app", undefined, { docker: true, layers: [{ entries: [{ name: "which", content: "docker-v2" }] }, { compression: "none", entries: [{ name: "raw", content: "r" }] }] });
  await pushIndex(reg, "docker/app", "list", [{ ...one, platform: { os: "linux", architecture: "amd64" } }], { docker: true });
  const img = await importOf("docker/app:list");
  const dirs = img.layers.map((l) => l.dir);
  assert.equal((await readFromStack(dirs, "/which"))?.toString(), "docker-v2");
  assert.equal((await readFromStack(dirs, "/raw"))?.toString(), "r");
  assert.equal(img.digest, one.digest, "the platform manifest is the source's identity");
});

test("manifests with os.version or non-empty os.features are rejected, naming the manifest and why", opt, async () => {
  const feat = await pushImage(reg, "osreq/app", "features", { layers: [{ entries: [{ name: "f", content: "x" }] }], extraConfig: { "os.features": ["win32k"] } });
  const msg = await rejection(importOf("osreq/app:features"));
  assert.ok(msg.includes(feat.digest), msg);
  assert.match(msg, /os\.features \["win32k"\]/);
  const plain = await pushImage(reg, "osreq/app", undefined, { layers: [{ entries: [{ name: "f", content: "y" }] }] });
  await pushIndex(reg, "osreq/app", "version", [{ ...plain, platform: { os: "linux", architecture: "amd64", "os.version": "10.0.17763" } }]);
  const msg2 = await rejection(importOf("osreq/app:version"));
  assert.ok(msg2.includes(plain.digest) && /os\.version "10\.0\.17763"/.test(msg2), msg2);
});

test("OCI special files are rejected naming the path; /dev, /proc and /sys contents from layers are dropped", opt, async () => {
  await pushImage(reg, "special/fifo", "v1", { layers: [{ entries: [{ name: "run/", type: "directory" }, { name: "run/pipe", type: "fifo" }] }] });
  assert.match(await rejection(importOf("special/fifo:v1")), /\/run\/pipe is a fifo/);
  await pushImage(reg, "special/chr", "v1", { layers: [{ entries: [{ name: "opt/tty0", type: "character-device" }] }] });
  assert.match(await rejection(importOf("special/chr:v1")), /\/opt\/tty0 is a character device/);
  await pushImage(reg, "special/dev", "v1", {
    layers: [{ entries: [{ name: "dev/", type: "directory" }, { name: "dev/null", type: "character-device" }, { name: "proc/1/x", content: "p" }, { name: "ok", content: "ok" }] }],
  });
  const img = await importOf("special/dev:v1");
  assert.ok(!existsSync(join(img.layers[0].dir, "dev/null")));
  assert.ok(!existsSync(join(img.layers[0].dir, "proc/1")));
  assert.equal(readFileSync(join(img.layers[0].dir, "ok"), "utf8"), "ok");
});

test("a hard link and an absolute symlink are kept; symlinks are never followed and links stay inside the root", opt, async () => {
  const hostPasswd = readFileSync("/etc/passwd", "utf8");
  await pushImage(reg, "links/app", "v1", {
    layers: [
      {
        entries: [
          { name: "etc/", type: "directory" },
          { name: "etc/real", content: "real\n" },
          { name: "etc/hard", type: "link", linkname: "etc/real" },
          { name: "etc/abs", type: "symlink", linkname: "/etc/passwd" },
          { name: "etc/abs", content: "replaced through the link?\n" },
        ],
      },
    ],
  });
  const img = await importOf("links/app:v1");
  const dir = img.layers[0].dir;
  assert.equal(statSync(join(dir, "etc/hard")).ino, statSync(join(dir, "etc/real")).ino, "one inode, two names");
  assert.equal(readFileSync("/etc/passwd", "utf8"), hostPasswd, "the host's /etc/passwd is untouched");
  assert.ok(lstatSync(join(dir, "etc/abs")).isFile(), "a later entry replaced the symlink itself");

  await pushImage(reg, "links/sym", "v1", { layers: [{ entries: [{ name: "bin", type: "symlink", linkname: "/usr/bin" }] }] });
  assert.equal(readlinkSync(join((await importOf("links/sym:v1")).layers[0].dir, "bin")), "/usr/bin", "the target is kept verbatim");

  await pushImage(reg, "links/outside", "v1", { layers: [{ entries: [{ name: "steal", type: "link", linkname: "../../../../etc/shadow" }] }] });
  assert.match(await rejection(importOf("links/outside:v1")), /escapes the image root/);
  await pushImage(reg, "links/through", "v1", { layers: [{ entries: [{ name: "out", type: "symlink", linkname: "/tmp" }, { name: "out/planted", content: "x" }] }] });
  assert.match(await rejection(importOf("links/through:v1")), /\/out\/planted lies under \/out, which this layer made a symlink/);
  await pushImage(reg, "links/dotdot", "v1", { layers: [{ entries: [{ name: "../evil", content: "x" }] }] });
  assert.match(await rejection(importOf("links/dotdot:v1")), /escapes the image root/);
});

test("extended attributes from PAX records are kept, except overlayfs's own trusted.* namespace", opt, async () => {
  await pushImage(reg, "xattr/app", "v1", {
    layers: [
      {
        entries: [
          { name: "tagged", content: "x", pax: { "SCHILY.xattr.user.kiln": "flame" } },
          { name: "forged/", type: "directory", pax: { "SCHILY.xattr.trusted.overlay.opaque": "y" } },
        ],
      },
    ],
  });
  const dir = (await importOf("xattr/app:v1")).layers[0].dir;
  const get = (path: string, name: string) =>
    spawnSync("getfattr", ["--only-values", "-n", name, join(dir, path)]).stdout.toString();
  assert.equal(get("tagged", "user.kiln"), "flame");
  assert.equal(get("forged", "trusted.overlay.opaque"), "", "a layer cannot make a directory opaque by xattr");
});

test("whiteouts become 0:0 character devices and an opaque directory gets trusted.overlay.opaque", opt, async () => {
  await pushImage(reg, "wh/app", "v1", {
    layers: [
      { entries: [{ name: "a/keep", content: "k" }, { name: "a/gone", content: "g" }, { name: "b/old", content: "o" }, { name: "c/dir/deep", content: "d" }] },
      { entries: [{ name: "a/.wh.gone", content: "" }, { name: "b/", type: "directory" }, { name: "b/.wh..wh..opq", content: "" }, { name: "b/new", content: "n" }, { name: "c/.wh.dir", content: "" }] },
    ],
  });
  const img = await importOf("wh/app:v1");
  const top = img.layers[1].dir;
  const gone = lstatSync(join(top, "a/gone"));
  assert.ok(gone.isCharacterDevice() && gone.rdev === 0 && gone.uid === 0 && gone.gid === 0, "a 0:0 character device");
  assert.equal(execFileSync("getfattr", ["--only-values", "-n", "trusted.overlay.opaque", join(top, "b")], { stdio: ["ignore", "pipe", "ignore"] }).toString(), "y");
  assert.ok(!existsSync(join(top, "a/.wh.gone")) && !existsSync(join(top, "b/.wh..wh..opq")));
  const dirs = img.layers.map((l) => l.dir);
  assert.equal((await readFromStack(dirs, "/a/keep"))?.toString(), "k");
  assert.equal(await readFromStack(dirs, "/a/gone"), undefined);
  assert.equal(await readFromStack(dirs, "/b/old"), undefined, "the opaque dir hides what lower layers had");
  assert.equal((await readFromStack(dirs, "/b/new"))?.toString(), "n");
  assert.equal(await readFromStack(dirs, "/c/dir/deep"), undefined);
});

test("User in all six forms resolves against the image's own /etc/passwd and /etc/group", opt, async () => {
  const passwd = "root:x:0:0:root:/root:/bin/sh\napp:x:1001:1002:app:/home/app:/bin/sh\n";
  const group = "root:x:0:\nstaff:x:50:\napp:x:1002:\n";
  const base = { entries: [{ name: "etc/passwd", content: passwd }, { name: "etc/group", content: group }] };
  const cases: [string, { uid: number; gid: number }, string][] = [
    ["app", { uid: 1001, gid: 1002 }, "app"],
    ["1001", { uid: 1001, gid: 1002 }, "app"],
    ["app:staff", { uid: 1001, gid: 50 }, "app"],
    ["app:77", { uid: 1001, gid: 77 }, "app"],
    ["4242:staff", { uid: 4242, gid: 50 }, "u4242"],
    ["4242:4343", { uid: 4242, gid: 4343 }, "u4242"],
  ];
  for (const [i, [user, ids, name]] of cases.entries()) {
    await pushImage(reg, "users/app", `u${i}`, { layers: [base], config: { User: user, Env: ["A=1", "PATH=/bin"], WorkingDir: "/srv", Cmd: ["sh"] } });
    const img = await importOf(`users/app:u${i}`);
    assert.deepEqual(img.userIds, ids, `User ${user}`);
    assert.equal(img.config.user, name, `User ${user} runs as ${name}`);
    const accounts = (await readFromStack(img.layers.map((l) => l.dir), "/etc/passwd"))?.toString() ?? "";
    assert.ok(accounts.startsWith(passwd), "the image's own accounts are kept");
    if (name === "u4242") assert.ok(accounts.includes(`u4242:x:4242:${ids.gid}:`), "a uid the image does not list gets an account in Kiln's top layer");
    assert.deepEqual(img.config.env, { A: "1", PATH: "/bin" });
    assert.equal(img.config.workingDir, "/srv");
    assert.deepEqual(img.config.cmd, ["sh"]);
  }
  await pushImage(reg, "users/app", "none", { layers: [base] });
  assert.equal((await importOf("users/app:none")).config.user, "root", "no User means root");
  await pushImage(reg, "users/app", "missing", { layers: [base], config: { User: "nobody-here" } });
  assert.match(await rejection(importOf("users/app:missing")), /user "nobody-here", which the image's \/etc\/passwd does not have/);
  await pushImage(reg, "users/app", "nogroup", { layers: [base], config: { User: "app:wheel" } });
  assert.match(await rejection(importOf("users/app:nogroup")), /group "wheel"/);
});

test("a layer whose content does not match the config's diff id is refused", opt, async () => {
  const tar = await tarOf([{ name: "x", content: "x" }]);
  await pushImage(reg, "bad/diff", "v1", { layers: [{ tar }], extraConfig: { rootfs: { type: "layers", diff_ids: [sha256("something else")] } } });
  const cache = await mkdtemp(join(tmpdir(), "kiln-oci-cache-"));
  try {
    assert.match(await rejection(importOf("bad/diff:v1", { cache })), /does not match the diff id/);
  } finally {
    await rm(cache, { recursive: true, force: true });
  }
});

test("a registry is reached over plain HTTP only when KILN_INSECURE_REGISTRIES names it", opt, async () => {
  await pushImage(reg, "plain/app", "v1", { layers: [{ entries: [{ name: "x", content: "x" }] }] });
  const msg = await rejection(importImage(`${reg.host}/plain/app:v1`, { cacheDir, arch: "amd64", timeoutMs: 5000 }));
  // An unlisted loopback registry is not even connected to (over HTTPS or otherwise): see attack-oci.test.ts.
  assert.match(msg, /private or loopback.*KILN_INSECURE_REGISTRIES/);
});

test("a cancelled import stops with an error and leaves no partial layer", opt, async () => {
  await pushImage(reg, "cancel/app", "v1", { layers: [{ entries: [{ name: "x", content: "x" }] }] });
  const cache = await mkdtemp(join(tmpdir(), "kiln-oci-cache-"));
  const ctl = new AbortController();
  ctl.abort();
  const err = await importImage(`${reg.host}/cancel/app:v1`, { cacheDir: cache, insecureRegistries: [reg.host], arch: "amd64", signal: ctl.signal }).then(() => undefined, (e: Error) => e);
  assert.ok(err, "the import fails");
  assert.ok(!existsSync(join(cache, "layers")) || execFileSync("ls", [join(cache, "layers")]).toString() === "", "no layer dir was left");
  await rm(cache, { recursive: true, force: true });
});

test("what a killed import left (a half-unpacked layer) is swept; its partial download is resumed, not refetched", opt, async () => {
  const tar = await tarOf([{ name: "big", content: randomBytes(256 << 10) }]);
  await pushImage(reg, "killed/app", "v1", { layers: [{ tar, compression: "none" }] });
  const cache = await mkdtemp(join(tmpdir(), "kiln-oci-cache-"));
  const dead = spawnSync("true").pid!; // a pid that has exited: what a kill -9 leaves behind
  const hex = sha256(tar).slice(7);
  const stale = join(cache, "layers", `${hex}.tmp-${dead}-1`);
  mkdirSync(join(stale, "half"), { recursive: true });
  const partial = join(cache, "blobs", "sha256", `${hex}.partial`);
  mkdirSync(join(partial, ".."), { recursive: true });
  // A partial download is continued from where it stopped: bytes on disk that are wrong (here the start of another
  // tar of the same shape, which unpacks as well) make the whole blob fail its digest (and are deleted), which shows
  // they were used rather than fetched again.
  const other = await tarOf([{ name: "big", content: randomBytes(256 << 10) }]);
  writeFileSync(partial, other.subarray(0, tar.length >> 1));
  assert.match(await rejection(importImage(`${reg.host}/killed/app:v1`, { cacheDir: cache, insecureRegistries: [reg.host], arch: "amd64" })), /does not match its digest/);
  assert.ok(!existsSync(partial), "a partial that failed its digest is not kept");
  // The first half of the blob, as a download cut by the kill left it.
  writeFileSync(partial, tar.subarray(0, tar.length >> 1));
  const img = await importImage(`${reg.host}/killed/app:v1`, { cacheDir: cache, insecureRegistries: [reg.host], arch: "amd64" });
  assert.equal(readFileSync(join(img.layers[0].dir, "big")).length, 256 << 10);
  assert.ok(!existsSync(stale), "the dead process's half-unpacked layer is gone");
  assert.ok(!existsSync(partial), "the partial download was completed and used");
  await rm(cache, { recursive: true, force: true });
});
