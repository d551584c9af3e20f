// gVisor: a memory snapshot's disk made ready ahead (snapshot-spares.ts). Taken, the machine restored from the
// snapshot runs on it and another is made; a `kiln serve` killed with SIGKILL leaves its copies mounted, and the next
// server removes them at start; deleting the snapshot removes its copy; KILN_SNAPSHOT_SPARES bounds them (least
// recently used given up); nothing stays mounted or on a loop device.

import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { mkdtemp } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import { TEST_CACHE_DIR, TEST_RUNTIME } from "../support/paths.ts";
import { freePort } from "../support/net.ts";
import { stdoutOf, stopSnapshotKiln } from "./support.ts";

const KILN = join(import.meta.dirname, "..", "..", "bin", "kiln");

async function until(what: string, check: () => boolean, timeoutMs = 30_000) {
  const deadline = Date.now() + timeoutMs;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

const mountinfo = () => readFileSync("/proc/self/mountinfo", "utf8");
const loops = () => execFileSync("losetup", ["-a"], { encoding: "utf8" });

test("gVisor: a memory snapshot's disk is ready ahead; taken by the machine restored from it, removed after kill -9 and with its snapshot", { skip: TEST_RUNTIME !== "runsc" && "memory snapshots need gVisor" }, async () => {
  const dataDir = await mkdtemp(join(tmpdir(), "kiln-spares-"));
  const sparesDir = join(dataDir, "snapshot-spares");
  const spares = () => (existsSync(sparesDir) ? readdirSync(sparesDir) : []);
  /** Copies that are whole: their disk mounted (a copy is named only once made, but mounted last). */
  const mounted = () => spares().filter((n) => mountinfo().includes(join(sparesDir, n, "mnt")));
  const port = await freePort();
  const server = spawn(KILN, ["serve", "--port", String(port)], {
    env: { ...process.env, KILN_DATA_DIR: dataDir, KILN_CACHE_DIR: TEST_CACHE_DIR, KILN_API_KEY: TEST_KEY, KILN_WARM_POOL: "0", KILN_OCI_RUNTIME: "runsc" },
    stdio: ["ignore", "ignore", "ignore"],
  });
  const exited = new Promise<void>((resolve) => server.on("exit", () => resolve()));
  const url = `http://127.0.0.1:${port}`;
  const auth = { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" };
  const call = async (method: "POST" | "GET", path: string, body?: unknown) => {
    const res = await request(`${url}${path}`, { method, headers: auth, body: body === undefined ? undefined : JSON.stringify(body) });
    return { status: res.statusCode, body: (await res.body.json()) as any };
  };
  let parent: { id: string } | undefined;
  let snapshotId = "";
  let child = "";
  let first = "";
  let failed: unknown;
  try {
    for (let i = 0; i < 300 && !parent; i++) {
      const res = await call("POST", "/v1/machines", { internet: false }).catch(() => undefined);
      if (res?.status === 201) parent = res.body;
      else await new Promise((r) => setTimeout(r, 100));
    }
    assert.ok(parent, "the server came up and made a machine");
    assert.equal((await call("POST", `/v1/machines/${parent.id}/exec`, { cmd: "echo before > mark" })).body.exit_code, 0);
    const s = await call("POST", `/v1/machines/${parent.id}/snapshots`, { memory: true });
    assert.equal(s.status, 201, JSON.stringify(s.body));
    snapshotId = s.body.id;
    await until("the snapshot's disk to be ready ahead", () => mounted().length === 1);
    [first] = mounted();
    assert.ok(first.startsWith(`${snapshotId}.`), first);
    const c = await call("POST", "/v1/machines", { snapshot: snapshotId });
    assert.equal(c.status, 201, JSON.stringify(c.body));
    child = c.body.id;
    assert.ok(!spares().includes(first), "the machine took the ready copy");
    const out = await call("POST", `/v1/machines/${child}/exec`, { cmd: "cat mark" });
    assert.equal(out.body.stdout, "before\n", JSON.stringify(out.body));
    // The taken copy is the machine's disk now: its image on a loop device under the machine's name.
    assert.ok(loops().includes(join(dataDir, "disks", "machines", `${child}.img`)), "the machine's disk is the copy, attached");
    await until("another copy to be made after the use", () => mounted().length === 1);
  } catch (err) {
    failed = err;
  } finally {
    if (server.exitCode === null && server.signalCode === null) server.kill("SIGKILL");
    await exited;
  }
  if (!failed) assert.equal(mounted().length, 1, "a killed server leaves its copy mounted");

  // The next server removes the killed one's copies at start; machines from the snapshot still work without one.
  const k = await startTestKiln({ dataDir, env: { KILN_WARM_POOL: "0" } });
  try {
    if (failed) throw failed;
    assert.deepEqual(spares(), [], "the killed server's copies are gone at start");
    assert.ok(!mountinfo().includes(sparesDir), "nothing of them stays mounted");
    assert.ok(!loops().includes(join(dataDir, "disks", "spares")), "nothing of them stays on a loop device");
    assert.equal(await stdoutOf(k, child, "cat mark"), "before\n", "the machine that took a copy survived the crash");
    const again = await k.call("POST", "/v1/machines", { body: { snapshot: snapshotId } });
    assert.equal(again.status, 201, again.text);
    assert.equal(await stdoutOf(k, again.body.id, "cat mark"), "before\n");
    await until("a copy to be made after that use", () => mounted().length === 1);
    assert.equal((await k.call("DELETE", `/v1/snapshots/${snapshotId}`)).status, 200);
    assert.deepEqual(spares(), [], "deleting the snapshot removes its copy");
    assert.ok(!loops().includes(join(dataDir, "disks", "spares")), "and its loop device");
  } finally {
    // Whatever failed, the machines go (the killed server's too) and nothing may stay mounted or attached.
    for (const m of (await k.call("GET", "/v1/machines?limit=100")).body.machines ?? []) await k.call("DELETE", `/v1/machines/${m.id}`);
    await stopSnapshotKiln(k);
  }
});

test("gVisor: KILN_SNAPSHOT_SPARES bounds the copies kept ready; the least recently used is given up", { skip: TEST_RUNTIME !== "runsc" && "memory snapshots need gVisor" }, async () => {
  const k = await startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_SNAPSHOT_SPARES: "1" } });
  const sparesDir = join(k.dataDir, "snapshot-spares");
  const spares = () => (existsSync(sparesDir) ? readdirSync(sparesDir) : []);
  let most = 0;
  const seen = () => {
    most = Math.max(most, spares().length);
    return spares();
  };
  try {
    const m = await k.call("POST", "/v1/machines", { body: { internet: false } });
    assert.equal(m.status, 201, m.text);
    const a = await k.call("POST", `/v1/machines/${m.body.id}/snapshots`, { body: { memory: true } });
    assert.equal(a.status, 201, a.text);
    await until("the first snapshot's copy", () => seen().some((n) => n.startsWith(`${a.body.id}.`) && mountinfo().includes(join(sparesDir, n, "mnt"))));
    const b = await k.call("POST", `/v1/machines/${m.body.id}/snapshots`, { body: { memory: true } });
    assert.equal(b.status, 201, b.text);
    await until("the second snapshot's copy in place of the first's", () => {
      const names = seen();
      return names.length === 1 && names[0].startsWith(`${b.body.id}.`) && mountinfo().includes(join(sparesDir, names[0], "mnt"));
    });
    assert.equal(most, 1, "never more than one copy on disk");
    assert.ok(!loops().includes(`${a.body.id}.`), "the copy given up is off its loop device");
    await k.call("DELETE", `/v1/machines/${m.body.id}`);
  } finally {
    await stopSnapshotKiln(k);
  }
});
