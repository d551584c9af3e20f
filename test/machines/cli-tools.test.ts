// The CLI gaps of the first hour (issue 24, item 7), driven as a person runs `kiln`: `machines cp` both ways with a
// binary file, `machines shell` with piped input and at a terminal, machine limits on create, code contexts, and
// `deployments logs -f`.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { mkdtemp, readFile, rm, stat, writeFile, chmod, mkdir } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { cliPipes, cliPty } from "../support/cli.ts";

let k: TestKiln;
let m: string;
let dir: string;
before(async () => {
  k = await startTestKiln();
  dir = await mkdtemp(join(tmpdir(), "kiln-cli-tools-"));
  const res = await k.call("POST", "/v1/machines", { body: { template: "local/base", timeout_s: 900 } });
  assert.equal(res.status, 201, res.text);
  m = res.body.id;
});
after(async () => {
  await k?.close();
  if (dir) await rm(dir, { recursive: true, force: true });
});

async function kiln(args: string[], input?: string | Buffer) {
  const run = cliPipes(k.url, args);
  if (input !== undefined) run.write(input);
  run.end();
  const code = await run.exited;
  return { code, stdout: run.stdout(), stderr: run.stderr() };
}

async function sh(cmd: string) {
  const res = await k.call("POST", `/v1/machines/${m}/exec`, { body: { cmd } });
  assert.equal(res.status, 200, res.text);
  return res.body.stdout as string;
}

test("kiln machines cp round-trips a binary file both ways, keeping its bytes and mode", async () => {
  const bytes = randomBytes(300_000);
  const local = join(dir, "blob.bin");
  await writeFile(local, bytes);
  await chmod(local, 0o750);
  // Here → a machine directory (the file keeps its name), then back → a local directory.
  const up = await kiln(["machines", "cp", local, `${m}:/workspace/`]);
  assert.equal(up.code, 0, up.stderr);
  assert.equal((await sh("sha256sum < /workspace/blob.bin")).split(/\s+/)[0], createHash("sha256").update(bytes).digest("hex"));
  assert.equal((await sh("stat -c %a /workspace/blob.bin")).trim(), "750");
  const back = join(dir, "back");
  await mkdir(back);
  const down = await kiln(["machines", "cp", `${m}:/workspace/blob.bin`, back]);
  assert.equal(down.code, 0, down.stderr);
  assert.ok((await readFile(join(back, "blob.bin"))).equals(bytes));
  assert.equal((await stat(join(back, "blob.bin"))).mode & 0o777, 0o750);
  // A relative machine path resolves from /workspace; `-` is stdin and stdout.
  const renamed = await kiln(["machines", "cp", local, `${m}:copy.bin`]);
  assert.equal(renamed.code, 0, renamed.stderr);
  assert.equal((await sh("cmp /workspace/blob.bin /workspace/copy.bin && echo same")).trim(), "same");
  assert.equal((await kiln(["machines", "cp", "-", `${m}:/tmp/from-stdin`], "piped\n")).code, 0);
  assert.equal((await kiln(["machines", "cp", `${m}:/tmp/from-stdin`, "-"])).stdout, "piped\n");
});

test("kiln machines cp refuses what it cannot do, saying why", async () => {
  const both = await kiln(["machines", "cp", "a", "b"]);
  assert.equal(both.code, 1);
  assert.match(both.stderr, /<machine id>:<path> on one side/);
  const missing = await kiln(["machines", "cp", `${m}:/no/such/file`, dir]);
  assert.equal(missing.code, 1);
  assert.match(missing.stderr, /no such file in the machine/);
  const noMachine = await kiln(["machines", "cp", "mch_nosuchmachine:/etc/hostname", dir]);
  assert.equal(noMachine.code, 1);
  assert.match(noMachine.stderr, /No machine mch_nosuchmachine/);
  const tree = await kiln(["machines", "cp", `${m}:/etc`, dir]);
  assert.match(tree.stderr, /is a directory/);
});

test("kiln machines shell runs piped commands without a terminal and ends with them", async () => {
  const r = await kiln(["machines", "shell", m], "echo ok-$((40+2))\nwhoami\nexit 3\n");
  assert.equal(r.code, 3, r.stderr);
  assert.equal(r.stdout, "ok-42\nuser\n");
  // Input that just ends (no exit) ends the shell too.
  const eof = await kiln(["machines", "shell", m], "echo done\n");
  assert.equal(eof.code, 0);
  assert.equal(eof.stdout, "done\n");
});

test("kiln machines shell at a terminal: what is typed at once is not lost, and exit ends it", async () => {
  const term = cliPty(k.url, ["machines", "shell", m]);
  // Typed before the session exists: held and sent once it starts.
  term.write("echo typed-$((6*7))\r");
  await term.waitFor(/typed-42/);
  term.write("exit\r");
  assert.equal(await term.exited, 0);
});

test("kiln machines create takes vcpus, memory and disk", async () => {
  const r = await kiln(["machines", "create", "--vcpus", "2", "--memory", "768", "--disk", "2048", "--json"]);
  assert.equal(r.code, 0, r.stderr);
  const rec = JSON.parse(r.stdout);
  assert.equal(rec.vcpus, 2);
  assert.equal(rec.memory_mb, 768);
  const df = await k.call("POST", `/v1/machines/${rec.id}/exec`, { body: { cmd: "df -m / | tail -1 | awk '{print $2}'" } });
  const size = Number(df.body.stdout.trim());
  assert.ok(size > 1500 && size <= 2048, `disk of ${size} MiB`);
  const bad = await kiln(["machines", "create", "--disk", "1"]);
  assert.equal(bad.code, 1);
  assert.match(bad.stderr, /invalid_request/);
});

test("kiln code create makes a context whose state persists across runs", async () => {
  const made = await kiln(["code", "create", m, "--cwd", "/tmp"]);
  assert.equal(made.code, 0, made.stderr);
  const ctx = made.stdout.trim();
  assert.ok(ctx.length > 0);
  assert.equal((await kiln(["code", "run", m, "-c", ctx, "import os; x = 41; print(os.getcwd())"])).stdout, "/tmp\n");
  assert.equal((await kiln(["code", "run", m, "-c", ctx, "x + 1"])).stdout, "42\n");
  assert.match((await kiln(["code", "contexts", m])).stdout, new RegExp(`^${ctx}\\tpython\\t/tmp$`, "m"));
  assert.equal((await kiln(["code", "rm", m, ctx])).code, 0);
});

test("kiln deployments logs -f prints what the service writes next", async () => {
  const dep = await k.call("POST", "/v1/agent-deployments", {
    body: { name: "follow", template: "local/base", command: "echo first; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo second; exec python3 -m http.server 8000", port: 8000 },
  });
  assert.equal(dep.status, 201, dep.text);
  const svcs = await k.call("GET", `/v1/agent-deployments/${dep.body.id}/services`);
  const svc = svcs.body.services[0];
  const follow = cliPipes(k.url, ["deployments", "logs", "-f", dep.body.id, svc.id]);
  try {
    await follow.waitFor(/first\n/, 60_000);
    assert.doesNotMatch(follow.stdout(), /second/);
    let machine: string | null = null;
    for (let i = 0; i < 100 && !machine; i++) {
      machine = (await k.call("GET", `/v1/agent-deployments/${dep.body.id}/services/${svc.id}`)).body.machine_id;
      if (!machine) await new Promise((r) => setTimeout(r, 100));
    }
    await k.call("POST", `/v1/machines/${machine}/exec`, { body: { cmd: "touch /tmp/go" } });
    await follow.waitFor(/first\nsecond\n/, 30_000);
    assert.equal(follow.done(), false, "-f keeps following");
  } finally {
    follow.end();
    await k.call("DELETE", `/v1/agent-deployments/${dep.body.id}`);
  }
  await follow.exited;
});
