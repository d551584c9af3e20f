// Snapshots, fork and hibernation modes through the API, on the runtime of this run (runc, or runsc with
// KILN_OCI_RUNTIME): what a snapshot keeps, machines made from it, forks independent of each other and the parent,
// memory snapshots (gVisor) or their refusal (runc), hibernation that survives a restart, auto_resume, on_timeout,
// the bounds, the webhook events, and nothing left behind.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { existsSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import { createMachine, startSnapshotKiln, stdoutOf, stopSnapshotKiln } from "./support.ts";
import type { TestKiln } from "../support/kiln.ts";
import { TEST_RUNTIME } from "../support/paths.ts";

let k: TestKiln;
before(async () => {
  k = await startSnapshotKiln();
});
after(() => stopSnapshotKiln(k));

const create = (body: Record<string, unknown> = {}) => createMachine(k, body);
const sh = (id: string, cmd: string) => stdoutOf(k, id, cmd);

async function events(machineId: string) {
  const rows = await k.kiln.services.store.db.selectFrom("events").selectAll().where("machine_id", "=", machineId).orderBy("seq").execute();
  return rows.map((r) => ({ operation: r.operation, payload: JSON.parse(r.payload_json) }));
}

const snapshotFiles = () => readdirSync(join(k.dataDir, "disks", "snapshots"));

test("files written before a snapshot are in every machine made from it; later writes in the parent are not", async () => {
  const parent = await create({ metadata: { role: "parent" } });
  await sh(parent.id, "echo before > /workspace/kept");
  const s = await k.call("POST", `/v1/machines/${parent.id}/snapshots`, { body: { name: "first", metadata: { step: "1" } } });
  assert.equal(s.status, 201, s.text);
  assert.match(s.body.id, /^snp_/);
  assert.equal(s.body.machine_id, parent.id);
  assert.equal(s.body.template_id, parent.template_id);
  assert.equal(s.body.memory, false);
  assert.equal(s.body.status, "ready");
  assert.equal(s.body.name, "first");
  assert.deepEqual(s.body.metadata, { step: "1" });
  assert.ok(s.body.size_bytes > 0);
  await sh(parent.id, "echo after > /workspace/later; echo changed > /workspace/kept");
  const a = await create({ snapshot: s.body.id, envs: { ONLY_A: "a" } });
  const b = await create({ snapshot: s.body.id });
  for (const m of [a, b]) {
    assert.equal(m.snapshot_id, s.body.id);
    assert.equal(await sh(m.id, "cat /workspace/kept; test -e /workspace/later && echo later || echo no-later"), "before\nno-later\n");
  }
  assert.equal(await sh(a.id, "echo $ONLY_A"), "a\n", "create-time envs reach the new machine's processes");
  assert.equal(await sh(b.id, "echo ${ONLY_A:-unset}"), "unset\n");
  assert.equal((await k.call("GET", `/v1/snapshots/${s.body.id}`)).body.status, "ready");
  const listed = await k.call("GET", `/v1/snapshots?machine_id=${parent.id}`);
  assert.deepEqual(listed.body.snapshots.map((x: { id: string }) => x.id), [s.body.id]);
  assert.equal(listed.body.next_cursor, null);
  assert.deepEqual((await events(parent.id)).map((e) => e.operation), ["create", "snapshot"]);
  assert.equal((await events(parent.id))[1].payload.snapshot.id, s.body.id);
  // Deleting it is allowed while machines made from it live: each has its own copy of the disk.
  const del = await k.call("DELETE", `/v1/snapshots/${s.body.id}`);
  assert.equal(del.status, 200, del.text);
  assert.equal(del.body.status, "deleted");
  assert.ok(!snapshotFiles().includes(s.body.id), "its files are gone");
  assert.equal(await sh(a.id, "cat /workspace/kept"), "before\n");
  assert.equal((await k.call("DELETE", `/v1/snapshots/${s.body.id}`)).body.status, "deleted", "a second delete changes nothing");
  assert.equal((await k.call("GET", `/v1/snapshots?machine_id=${parent.id}`)).body.snapshots.length, 0);
  const again = await k.call("POST", "/v1/machines", { body: { snapshot: s.body.id } });
  assert.equal(again.status, 409, again.text);
});

test("a fork's children are independent of each other and of the parent, which keeps running", async () => {
  const parent = await create();
  await sh(parent.id, "echo shared > /workspace/f");
  const f = await k.call("POST", `/v1/machines/${parent.id}/fork`, { body: { count: 3, timeout_s: 120, metadata: { fork: "yes" } } });
  assert.equal(f.status, 201, f.text);
  const kids = f.body.machines as { id: string; status: string; metadata: Record<string, string>; timeout_s: number }[];
  assert.equal(kids.length, 3);
  assert.equal(new Set(kids.map((m) => m.id)).size, 3);
  for (const [i, m] of kids.entries()) {
    assert.equal(m.status, "running");
    assert.deepEqual(m.metadata, { fork: "yes" });
    assert.equal(m.timeout_s, 120);
    assert.equal(await sh(m.id, `cat /workspace/f; echo child${i} > /workspace/mine`), "shared\n");
  }
  for (const [i, m] of kids.entries()) assert.equal(await sh(m.id, "cat /workspace/mine"), `child${i}\n`);
  assert.equal(await sh(parent.id, "test -e /workspace/mine && echo yes || echo no"), "no\n");
  assert.equal((await k.call("GET", `/v1/machines/${parent.id}`)).body.status, "running");
  const fork = (await events(parent.id)).find((e) => e.operation === "fork");
  assert.deepEqual(fork?.payload.machines, kids.map((m) => m.id));
  // The fork's own snapshot is not kept: each child has its copy.
  assert.equal((await k.call("GET", `/v1/snapshots?machine_id=${parent.id}`)).body.snapshots.length, 0);
  assert.equal(snapshotFiles().length, 0);
});

if (TEST_RUNTIME === "runc") {
  test("runc: memory snapshots, memory forks and memory hibernation are 400 with the reason, never a silent disk-only one", async () => {
    const m = await create();
    for (const [path, body] of [
      [`/v1/machines/${m.id}/snapshots`, { memory: true }],
      [`/v1/machines/${m.id}/fork`, { memory: true }],
      [`/v1/machines/${m.id}/hibernate`, { memory: true }],
    ] as const) {
      const r = await k.call("POST", path, { body });
      assert.equal(r.status, 400, r.text);
      assert.match(r.body.error, /gVisor.*CRIU/);
    }
    assert.equal((await k.call("GET", `/v1/snapshots?machine_id=${m.id}`)).body.snapshots.length, 0);
    assert.equal((await k.call("GET", `/v1/machines/${m.id}`)).body.status, "running");
  });
} else {
  test("gVisor: a memory snapshot's process continues counting from where it was, in a machine made from it", async () => {
    const m = await create({ internet: false });
    await sh(m.id, "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 &");
    await sh(m.id, 'while [ "$(cat /tmp/count 2>/dev/null || echo 0)" -lt 10 ]; do sleep 0.05; done');
    const s = await k.call("POST", `/v1/machines/${m.id}/snapshots`, { body: { memory: true } });
    assert.equal(s.status, 201, s.text);
    assert.equal(s.body.memory, true);
    const parentAt = Number(await sh(m.id, "cat /tmp/count"));
    const bad = await k.call("POST", "/v1/machines", { body: { snapshot: s.body.id, internet: true } });
    assert.equal(bad.status, 400, "a memory snapshot restores into its own network setting");
    const child = await create({ snapshot: s.body.id });
    const n = Number(await sh(child.id, "cat /tmp/count"));
    assert.ok(n >= 10 && n <= parentAt + 40, `the child counts on from the snapshot (${n}, the parent was at ${parentAt})`);
    assert.ok(Number(await sh(child.id, `while [ "$(cat /tmp/count)" -le ${n} ]; do sleep 0.05; done; cat /tmp/count`)) > n);
    assert.ok(Number(await sh(m.id, "cat /tmp/count")) >= parentAt, "the parent keeps running");
  });
}

test("hibernate modes: disk stops the machine and keeps its files, resume boots it; freeze stays the default", async () => {
  const m = await create();
  await sh(m.id, "echo kept > /workspace/f");
  const h = await k.call("POST", `/v1/machines/${m.id}/hibernate`, { body: { memory: false } });
  assert.equal(h.status, 200, h.text);
  assert.equal(h.body.status, "hibernated");
  assert.equal(h.body.hibernate_mode, "disk");
  assert.ok(!(await k.kiln.services.driver.listLive()).some((l) => l.id === m.id), "no process of it runs");
  const r = await k.call("POST", `/v1/machines/${m.id}/resume`);
  assert.equal(r.body.status, "running");
  assert.equal(r.body.hibernate_mode, null);
  assert.equal(await sh(m.id, "cat /workspace/f"), "kept\n");
  const frozen = await k.call("POST", `/v1/machines/${m.id}/hibernate`);
  assert.equal(frozen.body.hibernate_mode, "freeze");
  await k.call("POST", `/v1/machines/${m.id}/resume`);
  const contradiction = await k.call("POST", `/v1/machines/${m.id}/hibernate`, { body: { memory: true, mode: "freeze" } });
  assert.equal(contradiction.status, 400);
  assert.equal((await k.call("POST", `/v1/machines/${m.id}/hibernate`, { body: { mode: "sleep" } })).status, 400);
});

test("a hibernated machine survives a restart of the server and resumes", async () => {
  const mode = TEST_RUNTIME === "runsc" ? "memory" : "disk";
  const m = await create({ internet: false });
  await sh(m.id, "echo survived > /workspace/s; nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 &");
  await sh(m.id, 'while [ "$(cat /tmp/count 2>/dev/null || echo 0)" -lt 5 ]; do sleep 0.05; done');
  assert.equal((await k.call("POST", `/v1/machines/${m.id}/hibernate`, { body: { mode } })).body.hibernate_mode, mode);
  const dataDir = k.dataDir;
  await k.stop();
  k = await startTestKiln({ dataDir, env: { KILN_WARM_POOL: "0" } });
  const after = await k.call("GET", `/v1/machines/${m.id}`);
  assert.equal(after.body.status, "hibernated", "adoption keeps a machine that sleeps without a process");
  assert.equal(after.body.hibernate_mode, mode);
  assert.equal((await k.call("POST", `/v1/machines/${m.id}/resume`)).body.status, "running");
  assert.equal(await sh(m.id, "cat /workspace/s"), "survived\n");
  const count = await sh(m.id, "cat /tmp/count 2>/dev/null || echo none");
  if (mode === "memory") assert.ok(Number(count) >= 5, `the counter went on from where it was saved (${count})`);
});

test("auto_resume wakes a hibernated machine on the next exec", async () => {
  const m = await create({ auto_resume: true });
  assert.equal(m.auto_resume, true);
  await sh(m.id, "echo awake > /workspace/a");
  await k.call("POST", `/v1/machines/${m.id}/hibernate`, { body: { memory: false } });
  assert.equal(await sh(m.id, "cat /workspace/a"), "awake\n");
  assert.equal((await k.call("GET", `/v1/machines/${m.id}`)).body.status, "running");
  // Without it, a hibernated machine answers 409 as before.
  const p = await k.call("PATCH", `/v1/machines/${m.id}`, { body: { auto_resume: false } });
  assert.equal(p.body.auto_resume, false);
  await k.call("POST", `/v1/machines/${m.id}/hibernate`);
  assert.equal((await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "true" } })).status, 409);
});

test("on_timeout hibernate: a machine past its timeout sleeps (holding no process) instead of being destroyed", async () => {
  const m = await create({ timeout_s: 1, on_timeout: "hibernate" });
  assert.equal(m.on_timeout, "hibernate");
  for (let i = 0; i < 100 && (await k.call("GET", `/v1/machines/${m.id}`)).body.status === "running"; i++) {
    await k.kiln.services.machines.sweepExpired();
    await new Promise((r) => setTimeout(r, 100));
  }
  const slept = (await k.call("GET", `/v1/machines/${m.id}`)).body;
  assert.equal(slept.status, "hibernated");
  assert.equal(slept.hibernate_mode, TEST_RUNTIME === "runsc" ? "memory" : "disk");
  assert.ok(Date.parse(slept.expires_at) > Date.now() + 24 * 3600 * 1000, "it may sleep for the hibernation bound");
  const woke = await k.call("POST", `/v1/machines/${m.id}/resume`);
  assert.equal(woke.body.status, "running");
  assert.ok(Date.parse(woke.body.expires_at) < Date.now() + 60_000, "awake, its own timeout runs again");
});

test("bad requests change nothing: unknown fields, bounds, unknown ids, template with snapshot, another disk size", async () => {
  const m = await create();
  const s = (await k.call("POST", `/v1/machines/${m.id}/snapshots`, { body: {} })).body;
  const cases: [string, string, unknown, number][] = [
    ["POST", `/v1/machines/${m.id}/snapshots`, { nope: 1 }, 400],
    ["POST", `/v1/machines/${m.id}/snapshots`, { name: "" }, 400],
    ["POST", `/v1/machines/${m.id}/fork`, { count: 0 }, 400],
    ["POST", `/v1/machines/${m.id}/fork`, { count: 1000 }, 400],
    ["POST", "/v1/machines/mch_00000000000000000000000000/snapshots", {}, 404],
    ["POST", "/v1/machines/mch_00000000000000000000000000/fork", {}, 404],
    ["POST", "/v1/machines", { snapshot: "snp_00000000000000000000000000" }, 404],
    ["POST", "/v1/machines", { snapshot: s.id, template: "local/base" }, 400],
    ["POST", "/v1/machines", { snapshot: s.id, disk_mb: 2048 }, 400],
    ["POST", "/v1/machines", { on_timeout: "explode" }, 400],
    ["GET", "/v1/snapshots/snp_00000000000000000000000000", undefined, 404],
    ["GET", "/v1/snapshots?cursor=garbage", undefined, 400],
    ["DELETE", "/v1/snapshots/snp_00000000000000000000000000", undefined, 404],
  ];
  for (const [method, path, body, status] of cases) {
    const r = await k.call(method, path, { body });
    assert.equal(r.status, status, `${method} ${path} ${JSON.stringify(body)}: ${r.text}`);
    if (status !== 404 || r.body) assert.ok(r.body.code && r.body.request_id, r.text);
  }
  assert.equal((await k.call("GET", `/v1/snapshots?machine_id=${m.id}`)).body.snapshots.length, 1, "no snapshot was made by a bad request");
  await k.call("DELETE", `/v1/snapshots/${s.id}`);
});

test("snapshots are bounded in number and by the disk floor, and a crash's leftovers are removed at start", async () => {
  const dataDir = k.dataDir;
  await k.stop();
  k = await startTestKiln({ dataDir, env: { KILN_WARM_POOL: "0", KILN_MAX_SNAPSHOTS: "1" } });
  for (const s of (await k.call("GET", "/v1/snapshots?limit=100")).body.snapshots) await k.call("DELETE", `/v1/snapshots/${s.id}`);
  const m = await create();
  const first = await k.call("POST", `/v1/machines/${m.id}/snapshots`, { body: {} });
  assert.equal(first.status, 201, first.text);
  const second = await k.call("POST", `/v1/machines/${m.id}/snapshots`, { body: {} });
  assert.equal(second.status, 409, second.text);
  assert.match(second.body.error, /KILN_MAX_SNAPSHOTS/);
  await k.call("DELETE", `/v1/snapshots/${first.body.id}`);
  await k.stop();
  k = await startTestKiln({ dataDir, env: { KILN_WARM_POOL: "0", KILN_MIN_FREE_DISK_MB: String(1 << 29) } });
  const full = await k.call("POST", `/v1/machines/${m.id}/snapshots`, { body: {} });
  assert.equal(full.status, 503, full.text);
  assert.equal(full.body.error_detail?.retryable, true);
  // What a crash between the copy and the record leaves: files no snapshot names, and a record still `creating`.
  await k.stop();
  const orphan = join(dataDir, "disks", "snapshots", "snp_orphan0000000000000000000");
  execFileSync("mkdir", ["-p", orphan]);
  execFileSync("cp", ["--reflink=always", join(dataDir, "disks", "machines", `${m.id}.img`), join(orphan, "disk.img")]);
  k = await startTestKiln({ dataDir, env: { KILN_WARM_POOL: "0" } });
  assert.ok(!existsSync(orphan), "files no snapshot names are removed at start");
});
