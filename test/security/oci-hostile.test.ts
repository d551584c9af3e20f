// A hostile OCI corpus, driven through POST /v1/templates/build as a user would: each image an image publisher or
// registry could serve to reach past the import — host files linked, deleted, capability-tagged or written through
// the layer's own symlinks, a config digest shaped like a path, truncated and corrupt layers, sizes that lie or
// explode — ends as a build_error (or a harmless layer), leaves a sentinel directory exactly as it was, leaves no
// partial layer, and the server keeps answering.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { existsSync, readdirSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { gzipSync, zstdCompressSync } from "node:zlib";
import type { IncomingMessage, ServerResponse } from "node:http";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { pushImage, registryAvailable, sha256, startRegistry, tarOf } from "../support/oci-registry.ts";
import type { TestRegistry } from "../support/oci-registry.ts";
import { configOf, manifestOf, startHostileRegistry } from "../support/hostile-registry.ts";
import type { HostileRegistry } from "../support/hostile-registry.ts";
import { fingerprint, makeSentinel } from "../support/sentinel.ts";

const skip = registryAvailable();
const opt = { skip };
const MiB = 1 << 20;

let reg: TestRegistry;
let bad: HostileRegistry;
let k: TestKiln;
let root: string;
let sentinel: string;
let before0: string;

before(async () => {
  if (skip) return;
  root = await mkdtemp(join(tmpdir(), "kiln-hostile-"));
  sentinel = join(root, "sentinel");
  execFileSync("mkdir", [sentinel]);
  makeSentinel(sentinel);
  before0 = fingerprint(sentinel);
  [reg, bad] = await Promise.all([startRegistry(), startHostileRegistry()]);
  k = await startTestKiln({
    env: {
      KILN_INSECURE_REGISTRIES: `${reg.host},${bad.host}`,
      KILN_OCI_MAX_IMAGE_BYTES: String(64 * MiB),
      KILN_OCI_MAX_LAYER_ENTRIES: "5000",
      KILN_BUILD_RETENTION_S: "0",
    },
  });
});

after(async () => {
  if (skip) return;
  await k?.close();
  await Promise.all([reg?.stop(), bad?.stop()]);
  await rm(root, { recursive: true, force: true });
});

interface Outcome {
  ok: boolean;
  message: string;
  code?: string;
}

/** One build from `base_image`, its SSE stream read to the end: the terminal entry's verdict. */
async function importBuild(name: string, image: string): Promise<Outcome> {
  const res = await request(`${k.url}/v1/templates/build`, {
    method: "POST",
    headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" },
    body: JSON.stringify({ name, base_image: image }),
  });
  const text = await res.body.text();
  assert.equal(res.statusCode, 200, text);
  const blocks = text.split("\n\n").filter((b) => b.includes("data: "));
  const last = blocks.at(-1)!;
  const event = /^event: (.*)$/m.exec(last)?.[1];
  const data = JSON.parse(/^data: (.*)$/m.exec(last)![1]);
  return { ok: event === "end", message: data.message ?? "", code: data.error_detail?.code };
}

async function serverAnswers(): Promise<void> {
  const r = await k.call("GET", "/v1/templates?limit=1");
  assert.equal(r.status, 200, "the server still answers");
}

/** No half-unpacked layer and no stray file anywhere in the importer's cache. */
function noPartialLayer(): void {
  const layers = join(k.dataDir, "oci", "layers");
  const names = existsSync(layers) ? readdirSync(layers) : [];
  assert.deepEqual(names.filter((n) => !/^([a-f0-9]{64}|kiln-[a-f0-9]{64})$/.test(n)), [], "only complete layer dirs");
}

function sentinelUntouched(): void {
  assert.equal(fingerprint(sentinel), before0, "nothing in the sentinel directory changed");
  assert.deepEqual(readdirSync(root).sort(), ["sentinel"], "nothing appeared beside it");
}

async function failsWith(name: string, image: string, pattern: RegExp): Promise<string> {
  const r = await importBuild(name, image);
  assert.equal(r.ok, false, `the build must fail: ${r.message}`);
  assert.equal(r.code, "build_error", r.message);
  assert.match(r.message, pattern);
  await serverAnswers();
  noPartialLayer();
  sentinelUntouched();
  return r.message;
}

test("a hard link through the layer's own symlink cannot link a host file into the image", opt, async () => {
  const nlink = Number(execFileSync("stat", ["-c", "%h", join(sentinel, "secret")]).toString());
  for (const [i, s] of [sentinel, "../../../../sentinel", "../../../sentinel"].entries()) {
    await pushImage(reg, "hostile/hardlink", `v${i}`, { layers: [{ entries: [{ name: "s", type: "symlink", linkname: s }, { name: "h", type: "link", linkname: "s/secret" }] }] });
    await failsWith(`hardlink-${i}`, `${reg.host}/hostile/hardlink:v${i}`, /hard link to "s\/secret", which is not a file in the same layer/);
  }
  assert.equal(Number(execFileSync("stat", ["-c", "%h", join(sentinel, "secret")]).toString()), nlink, "the secret gained no link");
});

test("whiteouts, xattrs (security.capability included) and times of entries under a directory later made a symlink never reach through it", opt, async () => {
  // cap_dac_override,cap_sys_admin=ep as a v2 file capability: what made a host file a root shell in the report.
  const cap = Buffer.alloc(20);
  cap.writeUInt32LE(0x02000001, 0);
  cap.writeUInt32LE((1 << 1) | (1 << 21), 4);
  for (const [i, target] of [sentinel, "../../../sentinel"].entries()) {
    await pushImage(reg, "hostile/through", `v${i}`, {
      layers: [
        {
          entries: [
            { name: "d/", type: "directory", mtime: new Date("2001-01-01T00:00:00Z") },
            { name: "d/.wh.victim", content: "" },
            { name: "d/.wh..wh..opq", content: "" },
            { name: "d/f", content: "layer f", pax: { "SCHILY.xattr.security.capability": cap.toString("latin1"), "SCHILY.xattr.user.evil": "1" } },
            { name: "d", type: "symlink", linkname: target },
          ],
        },
      ],
    });
    const r = await importBuild(`through-${i}`, `${reg.host}/hostile/through:v${i}`);
    assert.ok(r.ok || r.code === "build_error", r.message);
    await serverAnswers();
    noPartialLayer();
    sentinelUntouched();
  }
});

test("a v2 file capability in a layer is kept only as a v3 capability rooted at the machines' root, inert on the host", opt, async () => {
  const cap = Buffer.alloc(20);
  cap.writeUInt32LE(0x02000001, 0);
  cap.writeUInt32LE(1 << 13, 4); // cap_net_raw
  await pushImage(reg, "hostile/cap", "v1", { layers: [{ compression: "none", entries: [{ name: "ping", content: "x", mode: 0o755, pax: { "SCHILY.xattr.security.capability": cap.toString("latin1") } }] }] });
  const r = await importBuild("cap", `${reg.host}/hostile/cap:v1`);
  assert.ok(r.ok, r.message);
  const layers = join(k.dataDir, "oci", "layers");
  const dir = readdirSync(layers).map((n) => join(layers, n)).find((d) => existsSync(join(d, "ping")))!;
  const value = execFileSync("getfattr", ["--only-values", "-n", "security.capability", join(dir, "ping")]);
  assert.equal(value.length, 24, "a v3 capability");
  assert.equal(value.readUInt32LE(0), 0x03000001);
  assert.equal(value.readUInt32LE(20), 100000, "rooted at machine root (host uid 100000), not host root");
});

test("a config digest shaped like a path is refused before anything is fetched or written", opt, async () => {
  const target = join(dirname(k.dataDir), `travcfg-${randomBytes(4).toString("hex")}`);
  const digest = `sha256:../../../../${target.split("/").pop()}`;
  bad.manifest("trav/cfg", "v1", manifestOf({ digest, size: 64 }, []));
  bad.blob("trav/cfg", digest, (_req, res) => {
    res.writeHead(200, { "content-length": 64 });
    res.end("attacker bytes"); // cut short, as the report's registry did
  });
  await failsWith("trav-cfg", `${bad.host}/trav/cfg:v1`, /digest Kiln cannot check/);
  assert.ok(!existsSync(target) && !existsSync(`${target}.partial`), "no file written outside the cache");
  assert.ok(!bad.seen.some((l) => l.includes("/blobs/")), "nothing was fetched");
  bad.manifest("trav/layer", "v1", manifestOf({ digest: sha256("c"), size: 1 }, [{ digest: "sha256:../../x", size: 1 }]));
  await failsWith("trav-layer", `${bad.host}/trav/layer:v1`, /digest Kiln cannot check/);
  bad.manifest("trav/index", "v1", { schemaVersion: 2, mediaType: "application/vnd.oci.image.index.v1+json", manifests: [{ digest: "sha256:../../manifests/x", platform: { os: "linux", architecture: "amd64" } }] });
  await failsWith("trav-index", `${bad.host}/trav/index:v1`, /digest Kiln cannot check/);
});

test("truncated and corrupt layers end the build with a build_error, never the server (each twice)", opt, async () => {
  // A tar header declaring 8 GiB followed by 1 KiB: tar-stream's "Unexpected end of data" once killed the process.
  const full = await tarOf([{ name: "big", content: "", pax: { size: String(8 * 2 ** 30) } }]);
  const truncated = Buffer.concat([full.subarray(0, full.length - 1024), randomBytes(1024)]);
  const good = await tarOf([{ name: "a", content: randomBytes(64 << 10) }]);
  const corruptGzip = gzipSync(good);
  corruptGzip.fill(0x55, 100, 200);
  const cutZstd = zstdCompressSync(good).subarray(0, 4000);
  const cases: [string, Buffer, "none" | "gzip" | "zstd", RegExp][] = [
    ["truncated", truncated, "none", /Unexpected end of data/],
    ["truncated-gz", gzipSync(truncated), "gzip", /Unexpected end of data/],
    ["corrupt-gz", corruptGzip, "gzip", /could not be unpacked/],
    ["cut-zstd", cutZstd, "zstd", /could not be unpacked/],
  ];
  for (const [name, blob, compression, pattern] of cases) {
    const types = { none: "application/vnd.oci.image.layer.v1.tar", gzip: "application/vnd.oci.image.layer.v1.tar+gzip", zstd: "application/vnd.oci.image.layer.v1.tar+zstd" };
    const config = configOf([sha256(name === "truncated" || name === "truncated-gz" ? truncated : good)]);
    bad.blob("broken/layer", sha256(config), config);
    bad.blob("broken/layer", sha256(blob), blob);
    bad.manifest("broken/layer", name, manifestOf({ digest: sha256(config), size: config.length }, [{ digest: sha256(blob), size: blob.length, mediaType: types[compression] }]));
    for (const attempt of [1, 2]) await failsWith(`${name}-${attempt}`, `${bad.host}/broken/layer:${name}`, pattern);
  }
});

test("a registry that resets the connection mid-blob, or sends more than it declared, ends the build, never the server", opt, async () => {
  const tar = await tarOf([{ name: "a", content: randomBytes(256 << 10) }]);
  const config = configOf([sha256(tar)]);
  bad.blob("reset/app", sha256(config), config);
  bad.blob("reset/app", sha256(tar), (_req, res) => {
    res.writeHead(200, { "content-length": tar.length });
    res.write(tar.subarray(0, 1000));
    setTimeout(() => res.socket?.destroy(), 20);
  });
  bad.manifest("reset/app", "v1", manifestOf({ digest: sha256(config), size: config.length }, [{ digest: sha256(tar), size: tar.length }]));
  await failsWith("reset", `${bad.host}/reset/app:v1`, /could not be downloaded after 5 attempts/);

  // An endless blob declared small: refused at the first byte past the declared size, however much is sent.
  let sent = 0;
  const chunk = Buffer.alloc(64 << 10, 1);
  bad.blob("endless/app", sha256(config), config);
  bad.blob("endless/app", sha256(tar), (_req, res) => {
    res.writeHead(200);
    const pump = () => {
      while (sent < 2 ** 31 && res.write(chunk)) sent += chunk.length;
    };
    res.on("drain", pump);
    res.on("close", () => res.off("drain", pump));
    pump();
  });
  bad.manifest("endless/app", "v1", manifestOf({ digest: sha256(config), size: config.length }, [{ digest: sha256(tar), size: tar.length }]));
  await failsWith("endless", `${bad.host}/endless/app:v1`, /larger than the \d+ bytes its descriptor declares/);
  assert.ok(sent < 64 * MiB, `the download stopped early (${sent} bytes sent)`);
});

test("a config declared or served past KILN_OCI_MAX_CONFIG_BYTES is refused without holding it", opt, async () => {
  const huge = 5 * 10 ** 9;
  bad.manifest("big/config", "declared", manifestOf({ digest: sha256("x"), size: huge }, []));
  await failsWith("config-declared", `${bad.host}/big/config:declared`, /config .*exceeds 8 MiB \(KILN_OCI_MAX_CONFIG_BYTES\)/);
  const digest = `sha256:${createHash("sha256").update("small").digest("hex")}`;
  const rss0 = process.memoryUsage().rss;
  let sent = 0;
  bad.blob("big/config", digest, (_req, res) => {
    res.writeHead(200);
    const chunk = Buffer.alloc(1 << 20, 0x20);
    const pump = () => {
      while (sent < 2 ** 30 && res.write(chunk)) sent += chunk.length;
      if (sent >= 2 ** 30) res.end();
    };
    res.on("drain", pump);
    pump();
  });
  bad.manifest("big/config", "served", manifestOf({ digest, size: 1000 }, []));
  await failsWith("config-served", `${bad.host}/big/config:served`, /larger than the 1000 bytes its descriptor declares/);
  assert.ok(process.memoryUsage().rss - rss0 < 200 * MiB, "the server did not hold the served bytes");
});

test("a manifest past KILN_OCI_MAX_MANIFEST_BYTES and a 10,000-layer manifest are refused before any layer is fetched", opt, async () => {
  bad.manifest("big/manifest", "v1", (_req, res) => {
    res.writeHead(200, { "content-type": "application/vnd.oci.image.manifest.v1+json" });
    res.end(Buffer.alloc(6 * MiB, 0x20)); // no content-length is promised: counted as it arrives
  });
  await failsWith("manifest-big", `${bad.host}/big/manifest:v1`, /exceeds 4 MiB \(KILN_OCI_MAX_MANIFEST_BYTES\)/);
  const tar = await tarOf([{ name: "x", content: "x" }]);
  const layers = Array.from({ length: 10_000 }, () => ({ digest: sha256(tar), size: tar.length }));
  const config = configOf(layers.map(() => sha256(tar)));
  bad.blob("many/layers", sha256(config), config);
  bad.blob("many/layers", sha256(tar), tar);
  bad.manifest("many/layers", "v1", manifestOf({ digest: sha256(config), size: config.length }, layers));
  const t = Date.now();
  await failsWith("many-layers", `${bad.host}/many/layers:v1`, /layer count \(10000\) exceeds 39 \(KILN_OCI_MAX_LAYERS\)/);
  assert.ok(Date.now() - t < 30_000, "refused at once");
  assert.ok(!bad.seen.some((l) => l.includes(`/many/layers/blobs/${sha256(tar)}`)), "no layer was fetched");
});

test("a gzip bomb, an oversized entry and a layer of too many entries stop at their limits", opt, async () => {
  const bomb = await tarOf([{ name: "zeros", content: Buffer.alloc(256 * MiB) }]);
  await pushImage(reg, "hostile/bomb", "v1", { layers: [{ tar: bomb, compression: "gzip" }] });
  await failsWith("bomb", `${reg.host}/hostile/bomb:v1`, /uncompressed size exceeds 64 MiB \(KILN_OCI_MAX_IMAGE_BYTES\)/);
  const huge = await tarOf([{ name: "huge", content: "", pax: { size: String(9 * 2 ** 30) } }]);
  await pushImage(reg, "hostile/entry", "v1", { layers: [{ tar: huge.subarray(0, huge.length - 1024), compression: "gzip" }] });
  await failsWith("entry", `${reg.host}/hostile/entry:v1`, /layer entry \/huge exceeds 8 GiB \(KILN_OCI_MAX_ENTRY_BYTES\)/);
  await pushImage(reg, "hostile/entries", "v1", { layers: [{ entries: Array.from({ length: 6000 }, (_, i) => ({ name: `f${i}`, content: "" })) }] });
  await failsWith("entries", `${reg.host}/hostile/entries:v1`, /entry count exceeds 5000 \(KILN_OCI_MAX_LAYER_ENTRIES\)/);
});

test("cache/oci is collected: layers no artifact names go, layers a tagged artifact or a running import uses stay", opt, async () => {
  await pushImage(reg, "keep/app", "a", { layers: [{ entries: [{ name: "which", content: "a" }] }] });
  await pushImage(reg, "keep/app", "b", { layers: [{ entries: [{ name: "which", content: "b" }] }] });
  assert.ok((await importBuild("kept", `${reg.host}/keep/app:a`)).ok);
  const layersDir = join(k.dataDir, "oci", "layers");
  const dirOf = (content: string) => readdirSync(layersDir).find((n) => /^[a-f0-9]{64}$/.test(n) && existsSync(join(layersDir, n, "which")) && execFileSync("cat", [join(layersDir, n, "which")]).toString() === content);
  const a = dirOf("a")!;
  assert.ok(a);
  // The tag moves to an artifact from image b: a's artifact is untagged, expires at once (retention 0) and goes.
  assert.ok((await importBuild("kept", `${reg.host}/keep/app:b`)).ok);
  const b = dirOf("b")!;

  // A slow import holds what it has unpacked so far while a collection runs.
  const first = await tarOf([{ name: "which", content: "slow-first" }]);
  const second = await tarOf([{ name: "second", content: "x" }]);
  const config = configOf([sha256(first), sha256(second)]);
  let release!: () => void;
  const held = new Promise<void>((r) => (release = r));
  let asked!: () => void;
  const waiting = new Promise<void>((r) => (asked = r));
  bad.blob("slow/app", sha256(config), config);
  bad.blob("slow/app", sha256(first), first);
  bad.blob("slow/app", sha256(second), (_req: IncomingMessage, res: ServerResponse) => {
    asked();
    void held.then(() => res.writeHead(200, { "content-length": second.length }).end(second));
  });
  bad.manifest("slow/app", "v1", manifestOf({ digest: sha256(config), size: config.length }, [{ digest: sha256(first), size: first.length }, { digest: sha256(second), size: second.length }]));
  const slow = importBuild("slow", `${bad.host}/slow/app:v1`);
  await waiting;
  for (let i = 0; i < 100 && !dirOf("slow-first"); i++) await new Promise((r) => setTimeout(r, 50));
  const r = await k.kiln.services.builds.collect();
  assert.ok(r.ociLayers >= 1, JSON.stringify(r));
  assert.ok(!existsSync(join(layersDir, a)), "the layer only an expired artifact named is gone");
  assert.ok(existsSync(join(layersDir, b)), "the tagged artifact's layer stays");
  assert.ok(dirOf("slow-first"), "the running import's layer stays");
  release();
  assert.ok((await slow).ok);
  noPartialLayer();
});
