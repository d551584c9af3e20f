// A snapshot as a template build's base (`POST /v1/templates/build {from_snapshot}`), on the runtime of this run: the
// files its machine wrote (and removed) are in machines of the new template, later writes are not, steps run on them;
// a memory snapshot's processes are not carried (said in the log); unknown, deleted and other hosts' snapshots are
// refused; the template outlives the snapshot; nothing stays mounted.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { createMachine, startSnapshotKiln, stdoutOf, stopSnapshotKiln } from "./support.ts";
import type { TestKiln } from "../support/kiln.ts";
import { TEST_RUNTIME } from "../support/paths.ts";
import { build, buildOk } from "../builds/support.ts";
import { cliPipes } from "../support/cli.ts";

let k: TestKiln;
before(async () => {
  k = await startSnapshotKiln();
});
after(() => stopSnapshotKiln(k));

const create = (body: Record<string, unknown> = {}) => createMachine(k, body);
const sh = (id: string, cmd: string) => stdoutOf(k, id, cmd);

async function snapshot(id: string, body: Record<string, unknown> = {}) {
  const s = await k.call("POST", `/v1/machines/${id}/snapshots`, { body });
  assert.equal(s.status, 201, s.text);
  return s.body.id as string;
}

const readsLeft = () => (existsSync(join(k.dataDir, "snapshot-reads")) ? readdirSync(join(k.dataDir, "snapshot-reads")) : []);

test("from_snapshot: the files a machine wrote and removed before its snapshot are in machines of the new template; later writes are not", async () => {
  const prepared = await create();
  const wrote = await k.call("POST", `/v1/machines/${prepared.id}/exec`, {
    body: { cmd: "mkdir -p /workspace/app && echo prepared > /workspace/app/state && chown 1234:1234 /workspace/app/state && rm /etc/debian_version && echo gone-later > /workspace/later-removed", user: "root" },
  });
  assert.equal(wrote.body.exit_code, 0, wrote.text);
  const snap = await snapshot(prepared.id, { name: "prepared" });
  await sh(prepared.id, "echo after > /workspace/after; rm /workspace/later-removed");
  const b = await buildOk(k, { name: "from-snap", from_snapshot: snap, steps: [{ type: "run", command: "cat /workspace/app/state > /workspace/seen-by-step" }] });
  const record = await k.call("GET", `/v1/templates/from-snap/builds/${b.buildId}`);
  assert.equal(record.body.source_type, "template_base", record.text);
  assert.ok(b.events.some((e) => String(e.data.message ?? "").includes(`copying the files of snapshot ${snap}`)), "the log says where the files come from");
  const m = await create({ template: "from-snap" });
  assert.equal(await sh(m.id, "cat /workspace/app/state /workspace/seen-by-step /workspace/later-removed"), "prepared\nprepared\ngone-later\n");
  assert.equal(await sh(m.id, "stat -c %u:%g /workspace/app/state"), "1234:1234\n", "ownership as the machine saw it");
  assert.equal(await sh(m.id, "test -e /etc/debian_version && echo present || echo removed; test -e /workspace/after && echo after || echo no-after"), "removed\nno-after\n");
  // Machines of the template are its own: their writes reach neither the snapshot nor the machine it came from.
  await sh(m.id, "echo child > /workspace/app/state");
  assert.equal(await sh(prepared.id, "cat /workspace/app/state"), "prepared\n");
  assert.equal((await create({ snapshot: snap }).then((x) => sh(x.id, "cat /workspace/app/state"))), "prepared\n");

  // From the CLI (`kiln templates build --from-snapshot`); a rebuild from the same snapshot reuses the files copied once.
  const cli = cliPipes(k.url, ["templates", "build", "-n", "from-snap-2", "--from-snapshot", snap, "--run", "echo two > /workspace/two", "--json"]);
  cli.end();
  assert.equal(await cli.exited, 0, cli.stderr());
  const lines = cli.stdout().trim().split("\n");
  const entries = lines.slice(0, -1).map((l) => JSON.parse(l) as Record<string, unknown>);
  assert.ok(entries.some((e) => e.cache_layer === "layer" && e.cache_outcome === "hit" && String(e.cache_target).includes(snap)), "the snapshot's layer is a cache hit");
  assert.match(lines.at(-1)!, /^art_/, "the CLI prints the artifact");
  assert.equal(await sh((await create({ template: "from-snap-2" })).id, "cat /workspace/app/state /workspace/two"), "prepared\ntwo\n");

  // The template does not depend on the snapshot: deleted, the template's machines still have its files.
  assert.equal((await k.call("DELETE", `/v1/snapshots/${snap}`)).status, 200);
  assert.equal(await sh((await create({ template: "from-snap" })).id, "cat /workspace/app/state"), "prepared\n");
  const gone = await build(k, { name: "from-snap-3", from_snapshot: snap });
  assert.equal(gone.status, 409, gone.raw);
  assert.match(gone.envelope.error, new RegExp(`snapshot ${snap} is deleted`));
  assert.deepEqual(readsLeft(), [], "no read of a snapshot stays mounted");
});

test("from_snapshot refusals: unknown, malformed, another host's, with base_image or a dockerfile; nothing is built", async () => {
  const before = await k.kiln.services.store.db.selectFrom("builds").select("id").execute();
  const unknown = await build(k, { name: "nope", from_snapshot: "snp_00000000000000000000000000" });
  assert.equal(unknown.status, 404, unknown.raw);
  assert.match(unknown.envelope.error, /from_snapshot: no snapshot snp_0+/);
  const malformed = await build(k, { name: "nope", from_snapshot: "../../etc" });
  assert.equal(malformed.status, 400, malformed.raw);
  const m = await create();
  const snap = await snapshot(m.id);
  for (const extra of [{ base_image: "local/base" }, { dockerfile: "FROM local/base\n" }, { build_backend: "buildkit" }]) {
    const r = await build(k, { name: "nope", from_snapshot: snap, ...extra });
    assert.equal(r.status, 400, r.raw);
    assert.match(r.envelope.error, /from_snapshot/);
  }
  // Another host's snapshot (hosts share one store): its files are not here.
  const db = k.kiln.services.store.db;
  const { host_id: here } = await db.selectFrom("snapshots").select("host_id").where("id", "=", snap).executeTakeFirstOrThrow();
  await db.updateTable("snapshots").set({ host_id: "another-host" }).where("id", "=", snap).execute();
  const elsewhere = await build(k, { name: "nope", from_snapshot: snap });
  assert.equal(elsewhere.status, 409, elsewhere.raw);
  assert.match(elsewhere.envelope.error, /another host \(another-host\)/);
  await db.updateTable("snapshots").set({ host_id: here }).where("id", "=", snap).execute();
  assert.equal((await db.selectFrom("builds").select("id").execute()).length, before.length, "no build was recorded");
  assert.equal((await k.call("GET", "/v1/templates/nope")).status, 404);
});

if (TEST_RUNTIME === "runsc") {
  test("gVisor: a memory snapshot as a base keeps its files, not its processes, and the build log says so", async () => {
    const m = await create({ internet: false });
    await sh(m.id, "echo file > /workspace/f; nohup sh -c 'kiln_keepme=1; while true; do sleep 1; done' >/dev/null 2>&1 &");
    const running = `for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '[k]iln_keepme' || true`;
    assert.equal(await sh(m.id, running), "1\n");
    const snap = await snapshot(m.id, { memory: true });
    const b = await buildOk(k, { name: "from-mem-snap", from_snapshot: snap });
    assert.ok(b.events.some((e) => e.data.kind === "warning" && /start their processes afresh/.test(String(e.data.message))), "the log says processes are not kept");
    const child = await create({ template: "from-mem-snap" });
    assert.equal(await sh(child.id, "cat /workspace/f"), "file\n");
    assert.equal(await sh(child.id, running), "0\n", "the snapshot's process does not run in the template's machines");
  });
}
