// A killed server's ready copies of snapshot disks (snapshot-spares.ts) go at the next start; an image whose directory
// was removed first (a kill between discardLayer's two removals), which no directory names any more, goes once the
// disk pool is open (the first copy made, or the close); a live server's copies stay.

import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { once } from "node:events";
import { mkdir, mkdtemp, readdir, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createSnapshotSpares } from "../../src/runtime/oci/snapshot-spares.ts";
import type { DiskPool } from "../../src/runtime/oci/disk-pool.ts";
import { createLogger } from "../../src/log.ts";

const log = createLogger({ level: "silent", pretty: false });

test("snapshot spares: the sweep removes a killed server's copies, stray images included, and keeps a live server's", async () => {
  const root = await mkdtemp(join(tmpdir(), "kiln-spares-sweep-"));
  const dir = join(root, "snapshot-spares");
  const poolDir = join(root, "pool");
  const images = join(poolDir, "spares");
  await Promise.all([mkdir(dir, { recursive: true }), mkdir(images, { recursive: true })]);
  const dead = spawn("true");
  await once(dead, "exit");
  const live = spawn("sleep", ["60"]);
  try {
    const deadName = `snp_a.${dead.pid}-0badcafe-0`;
    const strayName = `snp_b.${dead.pid}-0badcafe-1`;
    const liveName = `snp_c.${live.pid}-12345678-0`;
    // A whole copy of the dead server, an image whose directory went first, and a copy of a live server.
    await mkdir(join(dir, deadName, "mnt"), { recursive: true });
    await writeFile(join(images, `${deadName}.img`), "x");
    await writeFile(join(images, `${strayName}.img`), "x");
    await mkdir(join(dir, liveName, "mnt"), { recursive: true });
    await writeFile(join(images, `${liveName}.img`), "x");
    const pool = { dir: poolDir, copies: "reflink" } as unknown as DiskPool;
    const spares = createSnapshotSpares({ dir, pool: async () => pool, owner: 0, max: 4, log });
    await spares.sweep();
    assert.deepEqual(await readdir(dir), [liveName], "at start the dead server's copy goes, the live server's stays");
    assert.deepEqual((await readdir(images)).sort(), [`${liveName}.img`, `${strayName}.img`].sort(), "the start's sweep leaves the pool closed: the stray image waits");
    // Once the pool is open anyway (here the close; else the first copy made), the stray image goes.
    await spares.close();
    assert.deepEqual(await readdir(images), [`${liveName}.img`], "the stray image goes; the live server's stays");
    assert.deepEqual(await readdir(dir), [liveName]);
  } finally {
    live.kill("SIGKILL");
    await rm(root, { recursive: true, force: true });
  }
});
