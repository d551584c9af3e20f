// E2B's snapshots, fork, pause({keepMemory}) and lifecycle (onTimeout: pause, autoResume) through the published `e2b`
// SDK against a real Kiln, on Kiln's snapshots service. Memory is kept where the runtime can (gVisor); on runc a
// default pause freezes the processes in place, so they live on either way.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { Sandbox, SandboxNotFoundError } from "e2b";
import type { SandboxOpts } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";

let k: TestKiln;
let opts: SandboxOpts;
const memoryRuntime = process.env.KILN_OCI_RUNTIME === "runsc";

before(async () => {
  k = await startTestKiln();
  const key = (await k.kiln.services.keys.create("e2b-snapshots", generateKeyIn("e2b"))).key;
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 120_000, timeoutMs: 300_000 };
});
after(async () => k?.close());

async function listSnapshots(o: Parameters<typeof Sandbox.listSnapshots>[0]) {
  const out = [];
  const pages = Sandbox.listSnapshots(o);
  while (pages.hasNext) out.push(...(await pages.nextItems()));
  return out;
}

test("createSnapshot keeps a sandbox's files; Sandbox.create(snapshotId or name) starts from them; listSnapshots and deleteSnapshot", async () => {
  const s = await Sandbox.create("base", opts);
  const children: Sandbox[] = [];
  try {
    await s.files.write("/home/user/state.json", '{"step": 1}');
    const name = `e2b-snap-${Date.now()}`;
    const snap = await s.createSnapshot({ name });
    assert.match(snap.snapshotId, /^snp_/);
    assert.deepEqual(snap.names, [name]);
    assert.equal(await s.isRunning(), true, "the sandbox goes on");
    await s.files.write("/home/user/state.json", '{"step": 2}');

    const listed = await listSnapshots({ ...opts, sandboxId: s.sandboxId });
    assert.deepEqual(listed, [{ snapshotId: snap.snapshotId, names: [name] }]);
    assert.deepEqual(await listSnapshots({ ...opts, name }), listed);
    const other = await Sandbox.create("base", opts);
    children.push(other);
    assert.deepEqual(await s.listSnapshots().nextItems().then((x) => x.map((i) => i.snapshotId)), [snap.snapshotId]);
    assert.deepEqual(await other.listSnapshots().nextItems(), []);

    const byId = await Sandbox.create(snap.snapshotId, opts);
    children.push(byId);
    assert.equal(await byId.files.read("/home/user/state.json"), '{"step": 1}');
    assert.notEqual(byId.sandboxId, s.sandboxId);
    const byName = await Sandbox.create(name, opts);
    children.push(byName);
    assert.equal(await byName.files.read("/home/user/state.json"), '{"step": 1}');

    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, opts), true);
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, opts), false);
    assert.deepEqual(await listSnapshots({ ...opts, sandboxId: s.sandboxId }), []);
    await assert.rejects(Sandbox.create(snap.snapshotId, opts), /not found/);
    // The machines made from it have their own copies.
    assert.equal(await byId.files.read("/home/user/state.json"), '{"step": 1}');
  } finally {
    for (const c of children) await c.kill().catch(() => undefined);
    await s.kill();
  }
});

test("fork makes count sandboxes with the parent's files; each goes its own way and the parent keeps running", async () => {
  const s = await Sandbox.create("base", opts);
  let forks: (Sandbox | Error)[] = [];
  try {
    await s.files.write("/tmp/shared.txt", "before the fork");
    forks = await s.fork({ count: 2, timeoutMs: 120_000 });
    assert.equal(forks.length, 2);
    const [a, b] = forks;
    assert.ok(a instanceof Sandbox && b instanceof Sandbox, String(forks));
    assert.equal(new Set([a.sandboxId, b.sandboxId, s.sandboxId]).size, 3);
    for (const f of [a, b]) {
      assert.match(f.sandboxId, /^[0-9a-z]{26}$/);
      assert.equal(await f.files.read("/tmp/shared.txt"), "before the fork");
    }
    await a.files.write("/tmp/shared.txt", "a's own");
    assert.equal(await b.files.read("/tmp/shared.txt"), "before the fork");
    assert.equal(await s.files.read("/tmp/shared.txt"), "before the fork");
    assert.equal((await s.getInfo()).state, "running");
    const endAt = (await a.getInfo()).endAt.getTime();
    assert.ok(endAt > Date.now() + 60_000 && endAt < Date.now() + 130_000, "the fork's timeout");
    await assert.rejects(Sandbox.fork("00000000000000000000000000", opts), SandboxNotFoundError);
  } finally {
    for (const f of forks) if (f instanceof Sandbox) await f.kill().catch(() => undefined);
    await s.kill();
  }
});

test("pause() keeps the processes (memory where the runtime can, else frozen); pause({keepMemory: false}) keeps only the files", async () => {
  const s = await Sandbox.create("base", opts);
  try {
    // A process of the machine's own (the layer's background commands end with its stream socket at any pause).
    await s.commands.run("setsid -f sleep 3600 >/dev/null 2>&1 </dev/null");
    await s.files.write("/home/user/kept.txt", "kept");
    assert.equal(await s.pause().catch((err: unknown) => {
      throw new Error(`pause failed: ${String(err)}; server errors: ${k.logs.filter((l) => /"level":50/.test(l)).join("").slice(-3000)}`);
    }), true);
    const machine = (await k.call("GET", `/v1/machines/mch_${s.sandboxId}`)).body;
    assert.equal(machine.hibernate_mode, memoryRuntime ? "memory" : "freeze");
    await Sandbox.connect(s.sandboxId, opts);
    assert.match((await s.commands.run("pgrep -x sleep || true")).stdout, /^\d+/m, "the sleep lives on");

    assert.equal(await s.pause({ keepMemory: false }), true);
    assert.equal((await k.call("GET", `/v1/machines/mch_${s.sandboxId}`)).body.hibernate_mode, "disk");
    await Sandbox.connect(s.sandboxId, { ...opts, onResume: "reboot" });
    assert.equal((await s.commands.run("pgrep -x sleep || true")).stdout, "", "a disk pause boots again");
    assert.equal(await s.files.read("/home/user/kept.txt"), "kept");

    // onResume "reboot" of a sandbox paused with its memory: Kiln resumes as paused, so it says so.
    await s.pause();
    await assert.rejects(Sandbox.connect(s.sandboxId, { ...opts, onResume: "reboot" }), /400: .*keepMemory: false/);
    await Sandbox.connect(s.sandboxId, opts);
  } finally {
    await s.kill();
  }
});

test("lifecycle onTimeout pause: the sandbox is paused (not killed) at its timeout and shows its lifecycle; autoResume is kept", async () => {
  // A sandbox without a lifecycle kills at its timeout (made first: under gVisor a create right after a memory resume
  // answered 500 once in a full run, not reproduced alone — see docs/snapshots.md, "What is not done yet").
  const plain = await Sandbox.create("base", opts);
  assert.deepEqual((await plain.getInfo()).lifecycle, { onTimeout: "kill", autoResume: false });
  await plain.kill();
  const s = await Sandbox.create("base", { ...opts, timeoutMs: 2_000, lifecycle: { onTimeout: "pause", autoResume: true } });
  try {
    await s.files.write("/tmp/survives.txt", "yes");
    const info = await s.getInfo();
    assert.deepEqual(info.lifecycle, { onTimeout: "pause", autoResume: true });
    let state = info.state;
    for (let i = 0; i < 600 && state !== "paused"; i++) {
      await new Promise((r) => setTimeout(r, 100));
      state = (await s.getInfo()).state;
    }
    assert.equal(state, "paused");
    const back = await Sandbox.connect(s.sandboxId, { ...opts, timeoutMs: 120_000 });
    assert.equal(await back.files.read("/tmp/survives.txt"), "yes");
  } finally {
    await s.kill();
  }
  // A filesystem-only pause at the timeout is not something Kiln can choose per sandbox: refused, nothing made.
  const before = (await k.call("GET", "/v1/machines")).body.machines.length;
  await assert.rejects(Sandbox.create("base", { ...opts, lifecycle: { onTimeout: { action: "pause", keepMemory: false } } }), /400: autoPauseMemory false/);
  assert.equal((await k.call("GET", "/v1/machines")).body.machines.length, before);
});
