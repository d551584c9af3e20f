// Machines' disks: a sparse ext4 image per machine, and a stock of ready (formatted, mounted) ones handed out by a
// rename. What a killed server left in stock is reused by the next; close leaves no mount or loop device behind.

import { test, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { existsSync, readFileSync, statSync } from "node:fs";
import { mkdir, mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createDiskStock, mountWritableLayer, unmountWritableLayer, writableLayer } from "../../src/runtime/oci/disk.ts";
import { createLogger } from "../../src/log.ts";

const log = createLogger({ level: "silent", pretty: false });
const root = await mkdtemp(join(tmpdir(), "kiln-disk-"));
after(() => rm(root, { recursive: true, force: true }));

const mounted = (path: string) => readFileSync("/proc/self/mountinfo", "utf8").includes(path);
const loops = () => execFileSync("losetup", ["-a"], { encoding: "utf8" });

async function waitFor(check: () => boolean) {
  for (let i = 0; i < 500 && !check(); i++) await new Promise((r) => setTimeout(r, 20));
  assert.ok(check());
}

test("a stock disk becomes a machine's by a rename, mounted, with its upper dir owned by machine root", async () => {
  const stockDir = join(root, "stock-a");
  const stock = createDiskStock({ dir: stockDir, sizeMb: 256, count: 1, owner: 100000, log });
  const machineDir = join(root, "m1");
  await mkdir(machineDir);
  const layer = writableLayer(machineDir);
  await mountWritableLayer(layer, 256, 100000, stock); // none in stock yet: formatted and mounted here; stock fills
  assert.ok(mounted(layer.mountPoint));
  assert.equal(statSync(layer.upper).uid, 100000);
  await waitFor(() => existsSync(stockDir) && execFileSync("ls", [stockDir], { encoding: "utf8" }).includes("spare-"));
  const second = writableLayer(join(root, "m2"));
  await mkdir(join(root, "m2"));
  await mountWritableLayer(second, 256, 100000, stock);
  assert.ok(mounted(second.mountPoint), "the spare's mount moved with its directory");
  assert.ok(loops().includes(second.image));
  for (const l of [layer, second]) {
    await unmountWritableLayer(l);
    assert.ok(!mounted(l.mountPoint));
    assert.ok(!loops().includes(l.image), "the loop device cleared itself");
  }
  await stock.close();
  assert.ok(!mounted(stockDir) && !loops().includes(stockDir), "close leaves no spare mounted");
});

test("spares a killed server left mounted are reused by the next one; another size is made on the spot", async () => {
  const stockDir = join(root, "stock-b");
  const first = createDiskStock({ dir: stockDir, sizeMb: 128, count: 2, owner: 100000, log });
  await first.take(join(root, "unused"), 128); // starts filling
  await waitFor(() => (readFileSync("/proc/self/mountinfo", "utf8").match(new RegExp(`${stockDir}/spare-`, "g")) ?? []).length === 2);
  // "killed": never closed. The next server's stock finds the two ready spares and formats none.
  const leftInodes = execFileSync("sh", ["-c", `stat -c %i ${stockDir}/spare-*/disk.img`], { encoding: "utf8" }).trim().split("\n");
  const next = createDiskStock({ dir: stockDir, sizeMb: 128, count: 2, owner: 100000, log });
  assert.equal(await next.take(join(root, "probe"), 64), false, "another size is not in stock");
  assert.equal(await next.take(join(root, "unused2"), 128), false); // the first take only starts the scan
  await waitFor(() => next.spares() === 2);
  const dir = join(root, "m3");
  await mkdir(dir);
  const layer = writableLayer(dir);
  await mountWritableLayer(layer, 128, 100000, next);
  assert.ok(mounted(layer.mountPoint));
  assert.ok(leftInodes.includes(String(statSync(layer.image).ino)), "the machine got a disk the killed server had made");
  await unmountWritableLayer(layer);
  await next.close();
  assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(stockDir), "nothing of the stock stays mounted");
  assert.ok(!loops().includes(stockDir));
});
