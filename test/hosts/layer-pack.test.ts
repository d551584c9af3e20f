// A layer as peers fetch it (src/hosts/layers/pack.ts): the same directory packs to the same bytes, and the directory
// the importer unpacks from that tar — a host that fetched the layer — packs to them again, so it serves the layer
// under the same content digest. Whiteouts, opaque directories, hard links, symlinks, modes, ownership in the
// machines' id range and user attributes survive the trip; a tar with one byte changed is refused by its digest.

import { test, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { chown, link, lstat, mkdir, mkdtemp, readFile, readlink, rm, symlink, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Readable } from "node:stream";
import { getAttribute, setAttribute } from "@napi-rs/xattr";
import { layerDigest, packLayer } from "../../src/hosts/layers/pack.ts";
import { unpackLayer } from "../../src/builder/oci/unpack.ts";
import { HOST_ID_BASE } from "../../src/runtime/oci/idmap.ts";

const root = await mkdtemp(join(tmpdir(), "kiln-layer-pack-"));
after(() => rm(root, { recursive: true, force: true }));

async function bytesOf(dir: string): Promise<Buffer> {
  const chunks: Buffer[] = [];
  for await (const c of packLayer(dir)) chunks.push(c as Buffer);
  return Buffer.concat(chunks);
}

test("a layer packs to the same bytes, and its unpacked copy packs to them again", async () => {
  const src = join(root, "src");
  await mkdir(join(src, "etc", "app"), { recursive: true });
  await mkdir(join(src, "opaque"), { recursive: true });
  await mkdir(join(src, "dev"), { recursive: true });
  await writeFile(join(src, "etc", "app", "conf"), "a=1\n", { mode: 0o640 });
  await link(join(src, "etc", "app", "conf"), join(src, "etc", "conf-link"));
  await symlink("app/conf", join(src, "etc", "sym"));
  await writeFile(join(src, "dev", "null-left-by-a-build"), "");
  execFileSync("mknod", [join(src, "etc", "gone"), "c", "0", "0"]);
  await setAttribute(join(src, "opaque"), "trusted.overlay.opaque", "y");
  await setAttribute(join(src, "etc", "app", "conf"), "user.note", "kept");
  for (const p of ["", "etc", "etc/app", "etc/app/conf", "opaque", "dev", "dev/null-left-by-a-build", "etc/gone"]) await chown(join(src, p), HOST_ID_BASE + 1000, HOST_ID_BASE + 1000);

  const first = await layerDigest(src);
  assert.equal((await layerDigest(src)).digest, first.digest, "the same directory, the same digest");
  const tar = await bytesOf(src);
  assert.equal(`sha256:${createHash("sha256").update(tar).digest("hex")}`, first.digest);
  assert.equal(tar.length, first.bytes);

  const copy = join(root, "copy");
  const r = await unpackLayer(Readable.from([tar]), "none", copy, { expectDiffId: first.digest });
  assert.equal(r.diffId, first.digest);
  assert.equal((await layerDigest(copy)).digest, first.digest, "the fetched copy serves under the same digest");

  // What overlayfs and the machine see is the same.
  const gone = await lstat(join(copy, "etc", "gone"));
  assert.ok(gone.isCharacterDevice() && gone.rdev === 0, "the whiteout is a whiteout again");
  assert.equal(Buffer.from((await getAttribute(join(copy, "opaque"), "trusted.overlay.opaque"))!).toString(), "y", "the opaque directory is opaque again");
  const conf = await lstat(join(copy, "etc", "app", "conf"));
  assert.equal(conf.mode & 0o7777, 0o640);
  assert.equal(conf.uid, HOST_ID_BASE + 1000, "ownership stays in the machines' id range");
  assert.equal((await lstat(join(copy, "etc", "conf-link"))).ino, conf.ino, "the hard link is a hard link");
  assert.equal(await readlink(join(copy, "etc", "sym")), "app/conf");
  assert.equal(await readFile(join(copy, "etc", "app", "conf"), "utf8"), "a=1\n");
  assert.equal(Buffer.from((await getAttribute(join(copy, "etc", "app", "conf"), "user.note"))!).toString(), "kept");
  assert.equal(existsSync(join(copy, "dev", "null-left-by-a-build")), false, "what is under /dev is the machine's, not the layer's");

  // One byte changed: refused by its digest.
  const bad = Buffer.from(tar);
  const at = bad.indexOf("a=1\n");
  bad[at] = "b".charCodeAt(0);
  await assert.rejects(unpackLayer(Readable.from([bad]), "none", join(root, "bad"), { expectDiffId: first.digest }), /does not match/);
});
