// E2B's semantics where they are easy to get subtly wrong, through the published `e2b` SDK against a real Kiln:
// what isRunning, connect and setTimeout do to a sandbox's life, how envd describes files, and how commands end.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { Sandbox, CommandExitError, TimeoutError } from "e2b";
import type { SandboxOpts } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";

let k: TestKiln;
let opts: SandboxOpts;
let sbx: Sandbox;

before(async () => {
  k = await startTestKiln();
  const key = (await k.kiln.services.keys.create("e2b-semantics", generateKeyIn("e2b"))).key;
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 30_000 };
  sbx = await Sandbox.create("base", { ...opts, timeoutMs: 300_000 });
});
after(async () => k?.close());

test("isRunning answers false once a sandbox is killed or paused, true again after connect", async () => {
  const s = await Sandbox.create("base", opts);
  assert.equal(await s.isRunning(), true);
  await s.pause();
  assert.equal(await s.isRunning(), false);
  const back = await Sandbox.connect(s.sandboxId, opts);
  assert.equal(await back.isRunning(), true);
  await back.kill();
  assert.equal(await back.isRunning(), false);
});

test("connect never shortens a running sandbox's timeout; setTimeout can shorten it", async () => {
  const s = await Sandbox.create("base", { ...opts, timeoutMs: 600_000 });
  try {
    const end = (await s.getInfo()).endAt.getTime();
    await Sandbox.connect(s.sandboxId, { ...opts, timeoutMs: 30_000 });
    assert.ok((await s.getInfo()).endAt.getTime() >= end - 1000, "connect kept the later end");
    await Sandbox.connect(s.sandboxId, { ...opts, timeoutMs: 1_200_000 });
    assert.ok((await s.getInfo()).endAt.getTime() > Date.now() + 1_100_000, "connect extended it");
    await s.setTimeout(60_000);
    assert.ok((await s.getInfo()).endAt.getTime() < Date.now() + 70_000, "setTimeout shortened it");
  } finally {
    await s.kill();
  }
});

test("getInfo and list give permissions as envd does (Go's mode string) and a symlink's target as an absolute path", async () => {
  await sbx.commands.run("mkdir -p /tmp/perm/sub && echo x > /tmp/perm/f.txt && chmod 644 /tmp/perm/f.txt && chmod 755 /tmp/perm/sub && cd /tmp/perm && ln -sf f.txt link");
  const f = await sbx.files.getInfo("/tmp/perm/f.txt");
  assert.equal(f.permissions, "-rw-r--r--");
  assert.equal(f.mode, 0o644);
  const d = await sbx.files.getInfo("/tmp/perm/sub");
  assert.equal(d.permissions, "drwxr-xr-x");
  const listed = await sbx.files.list("/tmp/perm");
  assert.equal(listed.find((e) => e.name === "f.txt")?.permissions, "-rw-r--r--");
  const link = listed.find((e) => e.name === "link");
  assert.equal(link?.symlinkTarget, "/tmp/perm/f.txt");
  assert.equal((await sbx.files.getInfo("/tmp/perm/link")).symlinkTarget, "/tmp/perm/f.txt");
});

test("removing a path that does not exist succeeds, as envd's Remove does", async () => {
  await sbx.files.remove("/tmp/never-there");
  await sbx.files.remove("/tmp/never/there/either");
});

test("killing a running command ends its wait() with a CommandExitError (signal: killed); a failing one says its exit status", async () => {
  const h = await sbx.commands.run("sleep 600", { background: true });
  assert.equal(await h.kill(), true);
  await assert.rejects(h.wait(), (err: unknown) => {
    assert.ok(err instanceof CommandExitError, String(err));
    assert.notEqual(err.exitCode, 0);
    assert.match(err.error ?? "", /signal: killed/);
    return true;
  });
  const h2 = await sbx.commands.run("echo a; sleep 600; echo b", { background: true });
  await sbx.commands.kill(h2.pid);
  await assert.rejects(h2.wait(), (err: unknown) => err instanceof CommandExitError && err.exitCode !== 0);
  await assert.rejects(sbx.commands.run("exit 3"), (err: unknown) => err instanceof CommandExitError && err.exitCode === 3 && err.message === "exit status 3");
});

test("command-scoped env vars reach a bash command line, with the sandbox's own envs beside them", async () => {
  const r = await sbx.commands.run('echo "$FOO:$BAR"; bash -c \'echo "$FOO"\'; env | grep ^FOO=', { envs: { FOO: "one", BAR: "two" } });
  assert.equal(r.stdout, "one:two\none\nFOO=one\n");
  const pty = await sbx.commands.run("echo $FOO", { envs: { FOO: "in-a-pty" }, background: true });
  assert.equal((await pty.wait()).stdout, "in-a-pty\n");
  const sandboxEnvs = await Sandbox.create("base", { ...opts, envs: { SBX_VAR: "from-create" } });
  try {
    assert.equal((await sandboxEnvs.commands.run("echo $SBX_VAR-$RUN_VAR", { envs: { RUN_VAR: "from-run" } })).stdout, "from-create-from-run\n");
  } finally {
    await sandboxEnvs.kill();
  }
});

test("a sandbox killed while a command runs ends the command's wait with the SDK's TimeoutError", async () => {
  const s = await Sandbox.create("base", opts);
  const h = await s.commands.run("sleep 600", { background: true });
  // Settled as soon as it fails (it may fail while kill is still answering).
  const outcome = h.wait().then(
    () => undefined,
    (err: unknown) => err,
  );
  await Sandbox.kill(s.sandboxId, opts);
  const err = await outcome;
  assert.ok(err instanceof TimeoutError, `${(err as Error)?.name}: ${(err as Error)?.message}`);
  assert.ok(!(err instanceof CommandExitError));
});
