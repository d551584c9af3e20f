// E2B background commands across pause() and Sandbox.connect(), through the published `e2b` SDK against a real Kiln:
// the command keeps running (runc freezes it in place, gVisor restores it with the machine's memory), stays listed,
// can be connected to again by pid with the output it produced since the pause replayed, takes stdin, can be killed,
// and wait() gives its exit. The agent keeps them (src/agent/kept.ts) within bounds: 1 MiB of output per process,
// 64 processes per machine; a destroyed sandbox leaves none behind.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { randomUUID } from "node:crypto";
import { Sandbox, CommandExitError } from "e2b";
import type { CommandHandle, SandboxOpts } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { KEPT_MAX, KEPT_RING_BYTES } from "../../src/agent/kept.ts";

let k: TestKiln;
let opts: SandboxOpts;
const gvisor = process.env.KILN_OCI_RUNTIME === "runsc";

before(async () => {
  k = await startTestKiln();
  const key = (await k.kiln.services.keys.create("e2b-pause-commands", generateKeyIn("e2b"))).key;
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 120_000, timeoutMs: 300_000 };
});
after(async () => k?.close());

/** Resolves when `pred` holds, polling at `everyMs`; rejects after `ms` (a loaded host gets generous bounds). */
async function until(what: string, pred: () => boolean | Promise<boolean>, ms = 60_000, everyMs = 50) {
  const end = Date.now() + ms;
  while (!(await pred())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, everyMs));
  }
}

const ticks = (text: string) => [...text.matchAll(/tick-(\d+)/g)].map((m) => Number(m[1]));

/** Host processes whose command line holds `marker` (under runc a machine's processes are the host's). */
function hostProcessesWith(marker: string): number[] {
  const out: number[] = [];
  for (const name of readdirSync("/proc")) {
    if (!/^\d+$/.test(name)) continue;
    try {
      if (readFileSync(`/proc/${name}/cmdline`, "utf8").includes(marker)) out.push(Number(name));
    } catch {
      // gone meanwhile
    }
  }
  return out;
}

test("a background command started before pause() is, after Sandbox.connect(), still listed; connect(pid) replays its output since the pause then goes on live; sendStdin reaches it; kill ends it and wait() gives its exit", async () => {
  const s = await Sandbox.create("base", opts);
  try {
    let before = "";
    const loop = await s.commands.run("i=0; while true; do echo tick-$i; i=$((i+1)); sleep 0.2; done", { background: true, onStdout: (d) => void (before += d) });
    const reader = await s.commands.run("read line; echo got-$line; exit 7", { background: true, stdin: true });
    await until("ticks before the pause", () => ticks(before).length >= 3);
    // The handles' streams end with the pause (the SDK's TimeoutError); nothing here waits on them.
    loop.wait().catch(() => undefined);
    reader.wait().catch(() => undefined);

    await s.pause();
    assert.equal(await s.isRunning(), false);
    const lastBefore = Math.max(...ticks(before));

    const r = await Sandbox.connect(s.sandboxId, opts);
    const listed = await r.commands.list();
    assert.deepEqual(listed.map((p) => p.pid).sort(), [loop.pid, reader.pid].sort(), "both commands are listed after the resume");
    assert.match(listed.find((p) => p.pid === loop.pid)!.args.join(" "), /tick-\$i/);

    let after = "";
    const again = await r.commands.connect(loop.pid, { onStdout: (d) => void (after += d) });
    await until("ticks after the resume", () => ticks(after).length >= 3);
    const seen = ticks(after);
    assert.equal(seen[0], lastBefore + 1, `the output continues where the client left it before the pause (before: ${lastBefore}, after: ${seen.slice(0, 5)})`);
    assert.deepEqual(seen, seen.map((_, i) => seen[0] + i), "nothing is lost or repeated");

    await r.commands.sendStdin(reader.pid, "hello\n");
    const readerAgain = await r.commands.connect(reader.pid);
    const done = await readerAgain.wait().then(
      () => assert.fail("exit 7 is a CommandExitError"),
      (err: unknown) => err,
    );
    assert.ok(done instanceof CommandExitError, String(done));
    assert.equal(done.exitCode, 7);
    assert.equal(done.stdout, "got-hello\n");

    // A second pause: the command was re-attached since the first, and goes on from where that client stood.
    again.wait().catch(() => undefined);
    await r.pause();
    const lastAfter = Math.max(...ticks(after));
    const r2 = await Sandbox.connect(s.sandboxId, opts);
    let third = "";
    const thrice = await r2.commands.connect(loop.pid, { onStdout: (d) => void (third += d) });
    await until("ticks after the second resume", () => ticks(third).length >= 2);
    assert.equal(ticks(third)[0], lastAfter + 1, `after the second pause (before: ${lastAfter}, after: ${ticks(third).slice(0, 5)})`);

    assert.equal(await r2.commands.kill(loop.pid), true);
    const killed = await thrice.wait().then(
      () => assert.fail("a killed command is a CommandExitError"),
      (err: unknown) => err,
    );
    assert.ok(killed instanceof CommandExitError, String(killed));
    assert.equal(killed.exitCode, -1);
    assert.match(killed.error ?? "", /signal: killed/);
    assert.deepEqual(await r2.commands.list(), []);
    assert.equal(await r2.commands.kill(loop.pid), false, "a killed command is gone");
  } finally {
    await s.kill();
  }
});

test("a command that finished while nobody was attached after the resume: connect(pid) replays the last 1 MiB of its output and wait() gives its exit", async () => {
  const s = await Sandbox.create("base", opts);
  try {
    // Its output comes after the pause: the first 2 MiB leave the 1 MiB ring before anyone re-attaches.
    await s.commands.run("test -e /tmp/go || sleep 2; head -c 3145728 /dev/zero | tr '\\0' x; echo END; exit 3", { background: true });
    const [{ pid }] = await s.commands.list();
    await s.pause();
    const r = await Sandbox.connect(s.sandboxId, opts);
    await until("the command's end", async () => (await r.commands.list()).length === 0, 60_000, 200);
    let out = "";
    const h = await r.commands.connect(pid, { onStdout: (d) => void (out += d) });
    const err = await h.wait().then(
      () => assert.fail("exit 3 is a CommandExitError"),
      (e: unknown) => e,
    );
    assert.ok(err instanceof CommandExitError, String(err));
    assert.equal(err.exitCode, 3);
    assert.equal(Buffer.byteLength(out), KEPT_RING_BYTES, "exactly the ring's bytes are replayed");
    assert.ok(out.endsWith("xxxEND\n"), out.slice(-20));
  } finally {
    await s.kill();
  }
});

test(`a sandbox keeps at most ${KEPT_MAX} background commands: one more is refused with a clear error, and one ending makes room`, async () => {
  const s = await Sandbox.create("base", opts);
  const handles: CommandHandle[] = [];
  try {
    for (let i = 0; i < KEPT_MAX; i++) {
      const h = await s.commands.run("sleep 600", { background: true });
      handles.push(h);
      await h.disconnect();
    }
    await assert.rejects(s.commands.run("sleep 600", { background: true }), /already keeps 64 background processes/);
    assert.equal((await s.commands.list()).length, KEPT_MAX);
    assert.equal(await s.commands.kill(handles[0].pid), true);
    await until("the killed command's end", async () => (await s.commands.list()).length === KEPT_MAX - 1, 30_000, 100);
    // An exited command makes room at once (it is dropped from the agent's grace before a start is refused).
    const next = await s.commands.run("echo room", { timeoutMs: 60_000 });
    assert.equal(next.stdout, "room\n");
  } finally {
    await s.kill();
  }
});

test("after a Kiln restart a background command is still listed, and connect(pid) replays what the agent holds of its output, then live", async () => {
  const s = await Sandbox.create("base", opts);
  try {
    let before = "";
    const loop = await s.commands.run("i=0; while true; do echo tick-$i; i=$((i+1)); sleep 0.2; done", { background: true, onStdout: (d) => void (before += d) });
    await until("ticks before the restart", () => ticks(before).length >= 2);
    await loop.disconnect();
    // (An SDK stream still open holds the server's close for a minute: detached first.)
    await k.stop();
    k = await startTestKiln({ dataDir: k.dataDir });
    opts = { ...opts, apiUrl: k.url, sandboxUrl: k.url };
    const r = await Sandbox.connect(s.sandboxId, opts);
    assert.deepEqual((await r.commands.list()).map((p) => p.pid), [loop.pid]);
    let after = "";
    const again = await r.commands.connect(loop.pid, { onStdout: (d) => void (after += d) });
    // The new server never saw where the old one stood: everything the ring holds comes again, from tick-0.
    await until("live ticks after the restart", () => ticks(after).length > Math.max(...ticks(before)) + 2);
    const seen = ticks(after);
    assert.deepEqual(seen, seen.map((_, i) => i));
    assert.equal(await r.commands.kill(loop.pid), true);
    await assert.rejects(again.wait(), CommandExitError);
  } finally {
    await Sandbox.kill(s.sandboxId, opts);
  }
});

test("a pause that does not keep memory (keepMemory: false) ends background commands: after connect none is listed and connect(pid) is not found", async () => {
  const s = await Sandbox.create("base", opts);
  try {
    const h = await s.commands.run("sleep 600", { background: true });
    await h.disconnect();
    await s.pause({ keepMemory: false });
    const r = await Sandbox.connect(s.sandboxId, opts);
    assert.deepEqual(await r.commands.list(), []);
    await assert.rejects(r.commands.connect(h.pid), /not found/i);
    assert.equal(await r.commands.kill(h.pid), false);
  } finally {
    await s.kill();
  }
});

test("a destroyed sandbox leaves no kept process behind, paused or running", async () => {
  for (const paused of [false, true]) {
    const marker = `kept-${randomUUID()}`;
    const s = await Sandbox.create("base", opts);
    try {
      // The shell waiting for its sleep carries the marker in its command line.
      const h = await s.commands.run(`sleep 1000; echo ${marker}`, { background: true });
      await h.disconnect();
      assert.equal((await s.commands.list()).length, 1);
      if (!gvisor) await until("the marked process on the host", () => hostProcessesWith(marker).length > 0, 30_000);
      if (paused) await s.pause();
    } finally {
      await Sandbox.kill(s.sandboxId, opts);
    }
    await until(`no process left with the marker (${paused ? "paused" : "running"})`, () => hostProcessesWith(marker).length === 0, 30_000);
    await assert.rejects(Sandbox.connect(s.sandboxId, opts), /not found/i);
  }
});
