// Exec output that streams (issue 24, item 1): `kiln machines exec` prints each line as the command writes it, with
// pipes and under a terminal, keeps what it printed when the command outlives --timeout, and the REST answer to a
// timed-out exec carries the output so far.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { cliPipes, cliPty } from "../support/cli.ts";

let k: TestKiln;
let m: string;
before(async () => {
  k = await startTestKiln();
  const res = await k.call("POST", "/v1/machines", { body: { template: "local/base", timeout_s: 900 } });
  assert.equal(res.status, 201, res.text);
  m = res.body.id;
});
after(async () => k?.close());

/** A command that prints a line, then waits for the test to create `flag` before printing the next and ending. */
const gated = (flag: string) => `echo line 1; while [ ! -e /tmp/${flag} ]; do sleep 0.05; done; echo line 2 >&2; echo line 3`;

async function touch(flag: string) {
  const res = await k.call("POST", `/v1/machines/${m}/exec`, { body: { cmd: `touch /tmp/${flag}` } });
  assert.equal(res.status, 200, res.text);
}

test("kiln machines exec streams each line as the command writes it (pipes)", async () => {
  const run = cliPipes(k.url, ["machines", "exec", m, gated("go-pipes")]);
  // "line 1" is printed while the command is still waiting for us: nothing is held until it ends.
  await run.waitFor(/^line 1\n$/);
  assert.equal(run.done(), false);
  await touch("go-pipes");
  assert.equal(await run.exited, 0);
  assert.equal(run.stdout(), "line 1\nline 3\n");
  assert.equal(run.stderr(), "line 2\n");
});

test("kiln machines exec streams each line as the command writes it (terminal)", async () => {
  const run = cliPty(k.url, ["machines", "exec", m, gated("go-pty")]);
  await run.waitFor(/line 1\r?\n/);
  assert.equal(run.done(), false);
  assert.doesNotMatch(run.stdout(), /line 3/);
  await touch("go-pty");
  assert.equal(await run.exited, 0);
  assert.match(run.stdout(), /line 1\r?\nline 2\r?\nline 3/);
});

test("kiln machines exec --timeout keeps the output so far and exits 124", async () => {
  const run = cliPipes(k.url, ["machines", "exec", "--timeout", "2", m, "echo start; echo warn >&2; sleep 60; echo never"]);
  assert.equal(await run.exited, 124);
  assert.equal(run.stdout(), "start\n");
  assert.match(run.stderr(), /^warn\nkiln: timeout: the command did not finish within 2 s/);
  // The command is gone with its timeout: nothing of it still runs in the machine.
  const deadline = Date.now() + 15_000;
  for (;;) {
    const left = await k.call("POST", `/v1/machines/${m}/exec`, { body: { cmd: "pgrep -xc sleep || true" } });
    if (left.body.stdout.trim() === "0") break;
    assert.ok(Date.now() < deadline, "the timed-out command still runs");
    await new Promise((r) => setTimeout(r, 100));
  }
});

test("kiln machines exec -i streams stdin to the command; exit codes and signals come back", async () => {
  const run = cliPipes(k.url, ["machines", "exec", "-i", m, "--", "sh", "-c", "read a; echo got $a; cat | wc -c"]);
  run.write("first\n");
  await run.waitFor(/got first\n/);
  run.write(Buffer.alloc(100_000, 120));
  run.end();
  assert.equal(await run.exited, 0);
  assert.equal(run.stdout(), "got first\n100000\n");

  assert.equal(await cliPipes(k.url, ["machines", "exec", m, "exit 7"]).exited, 7);
  assert.equal(await cliPipes(k.url, ["machines", "exec", m, "--", "sh", "-c", "kill -TERM $$"]).exited, 128 + 15);
  const missing = cliPipes(k.url, ["machines", "exec", "mch_nosuchmachine", "true"]);
  assert.equal(await missing.exited, 1);
  assert.match(missing.stderr(), /not_found/);
});

test("a timed-out REST exec answers 504 timeout with timed_out and the output so far", async () => {
  const res = await k.call("POST", `/v1/machines/${m}/exec`, { body: { cmd: "echo start; printf 'err' >&2; sleep 60", timeout_s: 1 } });
  assert.equal(res.status, 504, res.text);
  assert.equal(res.body.code, "timeout");
  const d = res.body.error_detail.details;
  assert.equal(d.timed_out, true);
  assert.equal(d.stdout, "start\n");
  assert.equal(d.stderr, "err");
  assert.ok(d.duration_ms >= 1000);
  const b64 = await k.call("POST", `/v1/machines/${m}/exec`, { body: { cmd: "printf '\\377\\000'; sleep 60", timeout_s: 1, encoding: "base64" } });
  assert.equal(b64.status, 504);
  assert.equal(b64.body.error_detail.details.stdout, Buffer.from([255, 0]).toString("base64"));
  assert.equal(b64.body.error_detail.details.encoding, "base64");
});
