// What unpacking a layer while its blob still downloads newly risks, against a registry that lies or stalls
// (test/support/hostile-registry.ts): a layer whose blob fails its digest only after it was all unpacked, a
// registry that stops sending mid-blob, a layer failing while others are half unpacked beside it, and a partial
// download on disk that is wrong. Each must leave no layer dir (complete or half-made) and record no stored layer.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { existsSync, readdirSync, readFileSync, writeFileSync, mkdirSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { gzipSync } from "node:zlib";
import type { ServerResponse } from "node:http";
import { importImage } from "../../src/builder/oci/import.ts";
import { registryAvailable, sha256, tarOf } from "../support/oci-registry.ts";
import { configOf, manifestOf, startHostileRegistry } from "../support/hostile-registry.ts";
import type { HostileRegistry } from "../support/hostile-registry.ts";

const skip = registryAvailable();
const opt = { skip };
const GZIP = "application/vnd.oci.image.layer.v1.tar+gzip";

let bad: HostileRegistry;
const caches: string[] = [];

before(async () => {
  if (skip) return;
  bad = await startHostileRegistry();
});

after(async () => {
  if (skip) return;
  await bad.stop();
  for (const c of caches) await rm(c, { recursive: true, force: true });
});

async function freshCache(): Promise<string> {
  const c = await mkdtemp(join(tmpdir(), "kiln-oci-stream-"));
  caches.push(c);
  return c;
}

/** A gzip layer of `files` files of 256 KiB of incompressible bytes: unpacking it takes many chunks. */
async function bulkLayer(files: number): Promise<{ tar: Buffer; gz: Buffer }> {
  const tar = await tarOf(Array.from({ length: files }, (_, i) => ({ name: `d/f${i}`, content: randomBytes(256 << 10) })));
  return { tar, gz: gzipSync(tar) };
}

/** Every name in the cache's layers dir (none means no layer, complete or half-made, was left). */
function layerNames(cache: string): string[] {
  const dir = join(cache, "layers");
  return existsSync(dir) ? readdirSync(dir).filter((n) => !n.startsWith("kiln-")) : [];
}

function partials(cache: string): string[] {
  const dir = join(cache, "blobs", "sha256");
  return existsSync(dir) ? readdirSync(dir).filter((n) => n.endsWith(".partial")) : [];
}

async function failure(p: Promise<unknown>): Promise<string> {
  const err = await p.then(() => undefined, (e: Error & { detail?: { code?: string } }) => e);
  assert.ok(err, "the import must fail");
  assert.equal(err.detail?.code, "build_error", `a build_error, got ${err.message}`);
  return err.message;
}

function serveConfig(repo: string, diffIds: string[]): { digest: string; size: number } {
  const config = configOf(diffIds);
  bad.blob(repo, sha256(config), config);
  return { digest: sha256(config), size: config.length };
}

test("a blob that fails its digest only after all of it was unpacked leaves no layer and records none stored", opt, async () => {
  const { tar, gz } = await bulkLayer(12);
  // The registry serves a valid layer under a digest that is not its own: every entry unpacks, the diff id even
  // matches, and only the blob's digest, known once its last byte has passed, says no.
  const claimed = sha256(Buffer.concat([gz, Buffer.from("x")]));
  bad.blob("lie/after", claimed, gz);
  bad.manifest("lie/after", "v1", manifestOf(serveConfig("lie/after", [sha256(tar)]), [{ digest: claimed, size: gz.length + 1, mediaType: GZIP }]));
  const cache = await freshCache();
  const outcomes: string[] = [];
  const msg = await failure(importImage(`${bad.host}/lie/after:v1`, { cacheDir: cache, insecureRegistries: [bad.host], arch: "amd64", onLayer: (e) => outcomes.push(e.outcome) }));
  assert.match(msg, /does not match its digest/);
  assert.deepEqual(outcomes, ["miss"], "the layer was looked up and never stored");
  assert.deepEqual(layerNames(cache), [], "no layer dir, complete or half-unpacked");
  assert.deepEqual(partials(cache), [], "the mismatched download is not kept to resume from");
  // Served honestly afterwards, the same layer imports: nothing of the failed attempt was taken as cached.
  bad.blob("lie/after", sha256(gz), gz);
  bad.manifest("lie/after", "v2", manifestOf(serveConfig("lie/after", [sha256(tar)]), [{ digest: sha256(gz), size: gz.length, mediaType: GZIP }]));
  const img = await importImage(`${bad.host}/lie/after:v2`, { cacheDir: cache, insecureRegistries: [bad.host], arch: "amd64" });
  assert.equal(readFileSync(join(img.layers[0].dir, "d", "f11")).length, 256 << 10);
});

test("a registry that stalls mid-blob is bounded by the timeout; the next import resumes from what came", opt, async () => {
  const { tar, gz } = await bulkLayer(8);
  const half = gz.length >> 1;
  const ranges: (string | undefined)[] = [];
  let stall = true;
  bad.blob("stall/app", sha256(gz), (req, res) => {
    ranges.push(req.headers.range);
    if (stall) {
      // Half the blob, then silence with the connection open (the Range asked for is ignored).
      res.writeHead(200, { "content-length": gz.length });
      res.write(gz.subarray(0, half));
      return;
    }
    const from = Number(/^bytes=(\d+)-$/.exec(req.headers.range ?? "")?.[1] ?? 0);
    res.writeHead(from ? 206 : 200, { "content-length": gz.length - from }).end(gz.subarray(from));
  });
  bad.manifest("stall/app", "v1", manifestOf(serveConfig("stall/app", [sha256(tar)]), [{ digest: sha256(gz), size: gz.length, mediaType: GZIP }]));
  const cache = await freshCache();
  const t = Date.now();
  const msg = await failure(importImage(`${bad.host}/stall/app:v1`, { cacheDir: cache, insecureRegistries: [bad.host], arch: "amd64", timeoutMs: 500 }));
  assert.match(msg, /could not be downloaded after 5 attempts/);
  assert.ok(Date.now() - t < 20_000, `bounded: ${Date.now() - t} ms for 5 attempts of 500 ms`);
  assert.deepEqual(layerNames(cache), [], "the half-unpacked layer is gone");
  assert.equal(ranges.length, 5);
  assert.deepEqual(ranges.slice(1), Array(4).fill(`bytes=${half}-`), "each retry asked for the rest, from what was already unpacked");
  assert.equal(partials(cache).length, 1, "what came is kept to resume from");
  stall = false;
  ranges.length = 0;
  const img = await importImage(`${bad.host}/stall/app:v1`, { cacheDir: cache, insecureRegistries: [bad.host], arch: "amd64", timeoutMs: 5000 });
  assert.deepEqual(ranges, [`bytes=${half}-`], "the next import fetched only the rest");
  assert.equal(readFileSync(join(img.layers[0].dir, "d", "f7")).length, 256 << 10);
  assert.deepEqual(partials(cache), []);
});

test("a layer failing while others are half unpacked beside it stops them at once and leaves none of them", { ...opt, timeout: 60_000 }, async () => {
  const a = await bulkLayer(8);
  const b = await bulkLayer(8);
  // A character device: refused as soon as its entry is read.
  const evilTar = await tarOf([{ name: "ok", content: "x" }, { name: "dev/../null", type: "character-device" }]);
  const evil = gzipSync(evilTar);
  let halves = 0;
  let released: () => void = () => {};
  const bothHalf = new Promise<void>((r) => (released = r));
  const closed: Promise<void>[] = [];
  // Part of a blob, then silence until the import gives up on it: half of it (files being unpacked as the failure
  // comes, the importer's reading held back by the unpacking), or a few bytes (the importer waiting on the network).
  const stalled = (gz: Buffer, upTo: number) => (_req: unknown, res: ServerResponse) => {
    closed.push(new Promise((r) => res.once("close", () => r())));
    res.writeHead(200, { "content-length": gz.length });
    res.write(gz.subarray(0, upTo), () => {
      if (++halves === 2) released();
    });
  };
  bad.blob("fail/mid", sha256(a.gz), stalled(a.gz, a.gz.length >> 1));
  bad.blob("fail/mid", sha256(b.gz), stalled(b.gz, 64));
  bad.blob("fail/mid", sha256(evil), (_req, res) => {
    void bothHalf.then(() => res.writeHead(200, { "content-length": evil.length }).end(evil));
  });
  const layers = [a.gz, evil, b.gz].map((gz) => ({ digest: sha256(gz), size: gz.length, mediaType: GZIP }));
  bad.manifest("fail/mid", "v1", manifestOf(serveConfig("fail/mid", [sha256(a.tar), sha256(evilTar), sha256(b.tar)]), layers));
  const cache = await freshCache();
  const outcomes: string[] = [];
  const t = Date.now();
  // With a one-minute timeout, only the failing layer stopping the others ends this quickly.
  const msg = await failure(importImage(`${bad.host}/fail/mid:v1`, { cacheDir: cache, insecureRegistries: [bad.host], arch: "amd64", timeoutMs: 60_000, onLayer: (e) => outcomes.push(e.outcome) }));
  assert.match(msg, /character device/);
  assert.ok(Date.now() - t < 30_000, `the stalled layers were stopped with the failing one (${Date.now() - t} ms)`);
  assert.ok(!outcomes.includes("stored"), `no layer stored: ${outcomes}`);
  assert.deepEqual(layerNames(cache), [], "no layer dir of any of the three, complete or half-unpacked");
  // Their downloads were dropped too, not left reading in the background until the timeout.
  let bound: NodeJS.Timeout | undefined;
  const dropped = await Promise.race([Promise.all(closed).then(() => true), new Promise<false>((r) => (bound = setTimeout(() => r(false), 10_000)))]);
  clearTimeout(bound);
  assert.ok(dropped && closed.length === 2, "both stalled connections were closed by the importer");
});

test("a partial download on disk that is wrong fails one import at most: it is deleted, the next import fetches afresh", opt, async () => {
  const { tar, gz } = await bulkLayer(2);
  bad.blob("poison/app", sha256(gz), gz);
  bad.manifest("poison/app", "v1", manifestOf(serveConfig("poison/app", [sha256(tar)]), [{ digest: sha256(gz), size: gz.length, mediaType: GZIP }]));
  const cache = await freshCache();
  const partial = join(cache, "blobs", "sha256", `${sha256(gz).slice(7)}.partial`);
  mkdirSync(join(partial, ".."), { recursive: true });
  writeFileSync(partial, randomBytes(gz.length >> 1)); // not even gzip
  const msg = await failure(importImage(`${bad.host}/poison/app:v1`, { cacheDir: cache, insecureRegistries: [bad.host], arch: "amd64" }));
  assert.match(msg, /could not be unpacked/);
  assert.ok(!existsSync(partial), "the wrong partial is gone");
  assert.deepEqual(layerNames(cache), []);
  const img = await importImage(`${bad.host}/poison/app:v1`, { cacheDir: cache, insecureRegistries: [bad.host], arch: "amd64" });
  assert.equal(readFileSync(join(img.layers[0].dir, "d", "f1")).length, 256 << 10);
});
