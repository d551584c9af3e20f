// The host-wide pool of machines' uid ranges on a registry dir of its own: ranges of the pool, claims that two pools
// (two servers) never share, release only by the claim's own machine, and the sweep of stale claims.

import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtemp, mkdir, readFile, readdir, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createIdRangePool } from "../../src/runtime/oci/id-ranges.ts";
import { CANONICAL_BASE, ID_POOL_END, ID_POOL_LAST, ID_RANGE, rangeBase, rangeOf } from "../../src/runtime/oci/idmap.ts";
import { createLogger } from "../../src/log.ts";

const log = createLogger({ level: "warn", pretty: false });

test("pool ranges start above the canonical one, are whole 65536-id ranges and end below the builds' ranges", () => {
  assert.equal(rangeBase(1), CANONICAL_BASE + ID_RANGE);
  assert.ok(rangeBase(ID_POOL_LAST) + ID_RANGE <= ID_POOL_END);
  assert.ok(rangeBase(ID_POOL_LAST) + 2 * ID_RANGE > ID_POOL_END, "the pool uses all it may");
  assert.throws(() => rangeBase(0), /outside the pool/);
  assert.throws(() => rangeBase(ID_POOL_LAST + 1), /outside the pool/);
  assert.equal(rangeOf(CANONICAL_BASE), 0);
  assert.equal(rangeOf(rangeBase(7) + 65535), 7);
  assert.equal(rangeOf(rangeBase(8)), 8);
  assert.equal(rangeOf(CANONICAL_BASE - 1), undefined);
  assert.equal(rangeOf(ID_POOL_END), undefined);
});

test("two pools on one registry (two servers) never hand out one range; release needs the claim's own machine", async () => {
  const root = await mkdtemp(join(tmpdir(), "kiln-ranges-"));
  try {
    const dir = join(root, "registry");
    const [a, b] = [createIdRangePool({ dir, log }), createIdRangePool({ dir, log })];
    const machines = await Promise.all(Array.from({ length: 40 }, async (_, i) => {
      const m = join(root, `m${i}`);
      await mkdir(m);
      return m;
    }));
    const claimed = await Promise.all(machines.map((m, i) => (i % 2 ? a : b).claim(m)));
    assert.equal(new Set(claimed).size, claimed.length, `distinct: ${claimed.join(",")}`);
    assert.ok(claimed.every((k) => k >= 1 && k <= ID_POOL_LAST));
    const record = JSON.parse(await readFile(join(dir, String(claimed[0])), "utf8"));
    assert.equal(record.machine_dir, machines[0]);

    // Another machine's release of the range changes nothing; its own frees it.
    await a.release(claimed[0], machines[1]);
    assert.ok((await a.claimed()).includes(claimed[0]));
    await b.release(claimed[0], machines[0]);
    assert.ok(!(await a.claimed()).includes(claimed[0]));
    assert.equal((await readdir(dir)).filter((n) => n.startsWith(".")).length, 0, "no temp files are left");
  } finally {
    await rm(root, { recursive: true, force: true });
  }
});

test("a sweep frees claims whose machine dir is gone, unless a process still runs on the range's ids", async () => {
  const root = await mkdtemp(join(tmpdir(), "kiln-ranges-"));
  const dir = join(root, "registry");
  const sleeper = { range: ID_POOL_LAST - 1 };
  let child: ReturnType<typeof spawn> | undefined;
  try {
    const pool = createIdRangePool({ dir, log });
    const live = join(root, "live");
    await mkdir(live);
    const kept = await pool.claim(live); // the first claim sweeps (nothing yet)
    await mkdir(dir, { recursive: true });
    const write = (k: number, machine: string) => writeFile(join(dir, String(k)), JSON.stringify({ machine_dir: machine, claimed_at: new Date().toISOString(), pid: 1 }));
    await write(ID_POOL_LAST, join(root, "gone")); // a server was killed between removing the dir and releasing
    await write(sleeper.range, join(root, "gone-too"));
    await writeFile(join(dir, ".claim-999999999-abc"), "{}"); // a temp file of a killed server
    // A process still runs as an id of that range (a machine's leftover): its range must stay taken.
    child = spawn("setpriv", [`--reuid=${rangeBase(sleeper.range) + 5}`, `--regid=${rangeBase(sleeper.range) + 5}`, "--clear-groups", "sleep", "30"], { stdio: "ignore" });
    const uid = String(rangeBase(sleeper.range) + 5);
    for (let i = 0; i < 500; i++) {
      const status = await readFile(`/proc/${child.pid}/status`, "utf8").catch(() => "");
      if (new RegExp(`^Uid:\\s+${uid}\\s`, "m").test(status)) break;
      await new Promise((r) => setTimeout(r, 10));
    }
    assert.equal(await pool.sweep(), 1);
    const left = await pool.claimed();
    assert.ok(left.includes(kept), "a live machine's claim stays");
    assert.ok(!left.includes(ID_POOL_LAST), "the stale claim is freed");
    assert.ok(left.includes(sleeper.range), "a range a process still runs on stays taken");
    assert.ok(!(await readdir(dir)).includes(".claim-999999999-abc"));
    child.kill("SIGKILL");
    await new Promise((r) => child!.once("exit", r));
    assert.equal(await pool.sweep(), 1);
    assert.deepEqual(await pool.claimed(), [kept]);
  } finally {
    child?.kill("SIGKILL");
    await rm(root, { recursive: true, force: true });
  }
});
