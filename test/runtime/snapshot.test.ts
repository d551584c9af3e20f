// The oci driver's snapshot primitives on the real runtime (runc, or runsc with KILN_OCI_RUNTIME): a running
// machine's disk copied at one instant (freeze, fsfreeze, reflink, thaw) into a snapshot machines start from; memory
// snapshots and memory hibernation under gVisor (refused with the reason under runc); nothing left behind.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createOciDriver } from "../../src/runtime/oci/driver.ts";
import type { LiveMachine, MachineDriver, MachineSpec } from "../../src/runtime/driver.ts";
import { prepareGuestRuntime } from "../../src/runtime/guest-runtime.ts";
import { ensureBaseTemplate } from "../../src/builder/base-template.ts";
import { bundleAgent, AGENT_SOURCES } from "../../src/agent/bundle.ts";
import { createLogger } from "../../src/log.ts";
import { createAgentClient } from "../../src/runtime/agent-client.ts";
import type { AgentClient } from "../../src/runtime/agent-client.ts";
import { TEST_CACHE_DIR, TEST_RUNTIME } from "../support/paths.ts";

const runtime = TEST_RUNTIME;
const skip = process.getuid?.() !== 0 ? "the oci driver needs root" : undefined;
const log = createLogger({ level: "warn", pretty: false });
let dataDir: string;
let layer: string;
let driver: MachineDriver;
const created = new Set<string>();
const agents = new Map<string, AgentClient>();

before(async () => {
  if (skip) return;
  layer = (await ensureBaseTemplate({ cacheDir: TEST_CACHE_DIR, log })).layerDir;
  const guestRuntimeDir = await prepareGuestRuntime({ dir: join(TEST_CACHE_DIR, "guest-runtime"), agentBundle: bundleAgent, agentSources: AGENT_SOURCES });
  dataDir = await mkdtemp(join(tmpdir(), "kiln-snap-"));
  driver = createOciDriver({ dataDir, runtime, hostAccess: false, log, guestRuntimeDir, diskPool: "auto" });
});

after(async () => {
  if (skip) return;
  await Promise.all([...agents.values()].map((a) => a.close()));
  for (const id of created) await driver.destroy(id);
  for (const s of await driver.listSnapshots()) await driver.deleteSnapshot(s);
  await driver.close();
  // Nothing of the data dir stays mounted or attached to a loop device once its machines and pool are gone.
  assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(dataDir), "no mount under the data dir");
  assert.ok(!execFileSync("losetup", ["-a"], { encoding: "utf8" }).includes(dataDir), "no loop device on a file of the data dir");
  await rm(dataDir, { recursive: true, force: true });
});

let seq = 0;
async function machine(over: Partial<MachineSpec> = {}): Promise<LiveMachine> {
  const id = `mch_s${process.pid}x${++seq}`;
  created.add(id);
  const live = await driver.create({ id, layers: [layer], hostname: id.replaceAll("_", "-"), vcpus: 1, memoryMb: 256, diskMb: 1024, internet: false, mounts: [], ...over });
  // Restored from another machine's memory, it is handed out (as create does) only once it has its own name.
  await live.renamed;
  return live;
}

async function sh(m: LiveMachine, line: string): Promise<string> {
  let agent = agents.get(m.agentSocket);
  if (!agent) agents.set(m.agentSocket, (agent = createAgentClient(m.agentSocket)));
  const r = await agent.exec({ cmd: line, timeout_ms: 20_000 });
  if (r.exit_code !== 0) throw new Error(`${JSON.stringify(line)} exited ${r.exit_code ?? r.signal}: ${Buffer.from(r.stderr_base64, "base64").toString()}`);
  return Buffer.from(r.stdout_base64, "base64").toString();
}

async function fresh(m: LiveMachine): Promise<LiveMachine> {
  await agents.get(m.agentSocket)?.close();
  agents.delete(m.agentSocket);
  return m;
}

const opt = { skip };

test("the disk pool reflinks: machines' disks and snapshots live on a filesystem that shares blocks", opt, async () => {
  await machine();
  const fsType = execFileSync("stat", ["-f", "-c", "%T", join(dataDir, "disks")], { encoding: "utf8" }).trim();
  assert.equal(fsType, "xfs", "the data dir (ext4 here) cannot reflink, so an XFS pool is mounted in it");
});

test("files written before a disk snapshot are in machines made from it; later writes in the parent are not", opt, async () => {
  const parent = await machine();
  await sh(parent, "echo before > /home/user/kept && head -c 20M /dev/urandom > /var/big && sha256sum /var/big > /var/big.sum");
  const snap = await driver.snapshot(parent.id, `snp_d${process.pid}a`, { memory: false });
  assert.equal(snap.memory, null);
  assert.ok(snap.sizeBytes >= 20 * 1024 * 1024, `the snapshot counts the disk it holds (${snap.sizeBytes})`);
  await sh(parent, "echo after > /home/user/later && echo changed > /home/user/kept");
  const child = await machine({ fromSnapshot: { disk: snap.disk } });
  assert.equal(await sh(child, "cat /home/user/kept"), "before\n");
  assert.equal(await sh(child, "test -e /home/user/later && echo yes || echo no"), "no\n");
  assert.equal(await sh(child, "sha256sum -c /var/big.sum >/dev/null && echo intact"), "intact\n");
  // Each is its own disk from here on.
  await sh(child, "echo child > /home/user/mine");
  assert.equal(await sh(parent, "test -e /home/user/mine && echo yes || echo no"), "no\n");
  assert.equal(await sh(parent, "cat /home/user/kept"), "changed\n", "the parent goes on with its own writes");
});

test("a snapshot of a frozen machine leaves it frozen; one of a running machine leaves it running", opt, async () => {
  const m = await machine();
  await sh(m, "echo x > /tmp/x");
  await fresh(m);
  await driver.hibernate(m.id, "freeze");
  await driver.snapshot(m.id, `snp_d${process.pid}b`, { memory: false });
  assert.equal((await driver.listLive()).find((l) => l.id === m.id)?.state, "paused");
  const live = await driver.resume(m.id, "freeze");
  assert.equal(await sh(live, "cat /tmp/x"), "x\n");
  await driver.snapshot(m.id, `snp_d${process.pid}c`, { memory: false });
  assert.equal((await driver.listLive()).find((l) => l.id === m.id)?.state, "running");
});

test("a snapshot cut short by a crash is thawed by the next look at live machines", opt, async () => {
  const m = await machine();
  // What a killed server leaves: the marker, the processes paused and the filesystem frozen.
  const dir = join(dataDir, "machines", m.id);
  await writeFile(join(dir, "snapshot-freeze"), JSON.stringify({ pid: 2 ** 22 + 1, resume: true })); // a pid no process has
  await fresh(m);
  await driver.hibernate(m.id, "freeze");
  execFileSync("fsfreeze", ["--freeze", join(dir, "disk", "mnt")]);
  const seen = (await driver.listLive()).find((l) => l.id === m.id);
  assert.equal(seen?.state, "running");
  assert.ok(!existsSync(join(dir, "snapshot-freeze")));
  assert.equal(await sh(m, "echo writable > /tmp/w && cat /tmp/w"), "writable\n");
});

test("a look at live machines during a snapshot leaves the machine being copied frozen", opt, async () => {
  const m = await machine();
  const dir = join(dataDir, "machines", m.id);
  await writeFile(join(dir, "snapshot-freeze"), JSON.stringify({ pid: process.pid, resume: true }));
  await fresh(m);
  await driver.hibernate(m.id, "freeze");
  assert.equal((await driver.listLive()).find((l) => l.id === m.id)?.state, "paused", "the snapshot's own freeze is not undone");
  assert.ok(existsSync(join(dir, "snapshot-freeze")));
  await rm(join(dir, "snapshot-freeze"));
  await driver.resume(m.id, "freeze");
});

test("hibernate to disk stops the machine and keeps its files; resume boots it again", opt, async () => {
  const m = await machine();
  await sh(m, "echo kept > /home/user/f");
  await fresh(m);
  await driver.hibernate(m.id, "disk");
  assert.ok(!(await driver.listLive()).some((l) => l.id === m.id), "no process of it runs");
  const live = await driver.resume(m.id, "disk");
  assert.equal(await sh(live, "cat /home/user/f"), "kept\n");
});

if (runtime === "runc") {
  test("runc: memory snapshots and memory hibernation are refused with the reason", opt, async () => {
    assert.match(driver.memorySnapshotsUnsupported() ?? "", /gVisor.*CRIU/);
    const m = await machine();
    await assert.rejects(driver.snapshot(m.id, `snp_d${process.pid}m`, { memory: true }), /gVisor/);
    await assert.rejects(driver.hibernate(m.id, "memory"), /gVisor/);
    assert.equal(await sh(m, "echo still"), "still\n");
  });
} else {
  const COUNTER = "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 &";
  // The counter rewrites its file (`>` truncates, then writes): a read in between sees it empty, so read again.
  const count = async (m: LiveMachine) => Number((await sh(m, 'for i in $(seq 200); do c=$(cat /tmp/count 2>/dev/null); [ -n "$c" ] && break; sleep 0.01; done; echo "$c"')).trim());

  test("gVisor: a memory snapshot's process continues counting from where it was, and the parent keeps running", opt, async () => {
    assert.equal(driver.memorySnapshotsUnsupported(), undefined);
    const parent = await machine();
    await sh(parent, COUNTER);
    await sh(parent, 'while [ "$(cat /tmp/count 2>/dev/null || echo 0)" -lt 10 ]; do sleep 0.05; done');
    const snap = await driver.snapshot(parent.id, `snp_m${process.pid}a`, { memory: true });
    // The snapshot is complete before its machine is restored from it; the machine is back once `continued` settles.
    assert.ok(snap.continued, "a memory snapshot tells when its machine runs again");
    await snap.continued;
    const at = await count(parent);
    assert.ok(snap.memory && existsSync(snap.memory));
    const child = await machine({ fromSnapshot: { disk: snap.disk, memory: snap.memory } });
    const first = await count(child);
    assert.ok(first >= 10 && first <= at + 40, `the child's counter starts where the parent's was (${first}, parent at ${at})`);
    await sh(child, `while [ "$(cat /tmp/count)" -le ${first} ]; do sleep 0.05; done`);
    const before = await count(parent);
    await sh(parent, `while [ "$(cat /tmp/count)" -le ${before} ]; do sleep 0.05; done`);
    assert.equal((await sh(child, "hostname")).trim(), child.id.replaceAll("_", "-"));
    // Restored from its own image, the parent keeps its own name (no rename is asked for).
    assert.equal((await sh(parent, "hostname")).trim(), parent.id.replaceAll("_", "-"));
  });

  test("gVisor: memory hibernation saves the processes, holds no memory, and resume continues them", opt, async () => {
    const m = await machine();
    await sh(m, COUNTER);
    await sh(m, 'while [ "$(cat /tmp/count 2>/dev/null || echo 0)" -lt 5 ]; do sleep 0.05; done');
    await fresh(m);
    await driver.hibernate(m.id, "memory");
    assert.ok(!(await driver.listLive()).some((l) => l.id === m.id), "the sandbox is gone while it sleeps");
    const usage = await driver.usage(m.id);
    assert.ok(!usage.memoryBytes, `no memory charged to it (${usage.memoryBytes})`);
    const live = await driver.resume(m.id, "memory");
    assert.equal(live.renamed, undefined, "its own image holds its own name: no rename");
    assert.equal((await sh(live, "hostname")).trim(), m.id.replaceAll("_", "-"));
    const n = await count(live);
    assert.ok(n >= 5, `the counter went on from its saved state (${n})`);
    await sh(live, `while [ "$(cat /tmp/count)" -le ${n} ]; do sleep 0.05; done`);
    assert.ok(!existsSync(join(dataDir, "machines", m.id, "hibernation")), "the saved image is consumed by the resume");
  });
}

test("deleting a snapshot removes its files; destroying a machine removes its disk image", opt, async () => {
  const m = await machine();
  const snap = await driver.snapshot(m.id, `snp_d${process.pid}z`, { memory: false });
  assert.ok(existsSync(snap.disk));
  await driver.deleteSnapshot(`snp_d${process.pid}z`);
  assert.ok(!existsSync(snap.disk) && !(await driver.listSnapshots()).includes(`snp_d${process.pid}z`));
  const image = join(dataDir, "disks", "machines", `${m.id}.img`);
  assert.ok(existsSync(image));
  await driver.destroy(m.id);
  created.delete(m.id);
  assert.ok(!existsSync(image), "the machine's image went with it");
});
