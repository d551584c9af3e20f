// Builds that cannot succeed are not retried (issue 24, item 8): a missing package or a step's own non-zero exit
// ends the build on its first attempt, and the final error names the step, its last lines and what to do.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { build } from "./support.ts";
import { judgeStepExit } from "../../src/builder/step-exit.ts";
import { cliPipes } from "../support/cli.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

test("only a fetch step whose output shows a network failure may be retried", () => {
  assert.equal(judgeStepExit(true, ["E: Unable to locate package nosuchpkg-xyz"]).retryable, false);
  assert.equal(judgeStepExit(true, ["ERROR: No matching distribution found for nosuch"]).retryable, false);
  assert.equal(judgeStepExit(true, ["npm error code E404"]).retryable, false);
  assert.equal(judgeStepExit(true, ["curl: (22) The requested URL returned error: 404"]).retryable, false);
  assert.equal(judgeStepExit(true, ["fatal: Remote branch nope not found in upstream origin"]).retryable, false);
  assert.equal(judgeStepExit(true, ["curl: (7) Failed to connect to 198.51.100.1 port 80"]).retryable, true);
  assert.equal(judgeStepExit(true, ["W: Failed to fetch http://deb.debian.org/…  Temporary failure resolving 'deb.debian.org'"]).retryable, true);
  assert.equal(judgeStepExit(true, ["E: Unable to locate package x", "Temporary failure resolving 'deb.debian.org'"]).retryable, false, "a missing package wins");
  assert.equal(judgeStepExit(true, ["something else went wrong"]).retryable, false);
  assert.equal(judgeStepExit(false, ["curl: (7) Failed to connect"]).retryable, false, "a run step is the user's command: never retried");
  assert.match(judgeStepExit(true, ["E: Unable to locate package x"]).suggestedAction, /package name/);
});

test("apt_install of a package that does not exist is answered once, naming the step and its last lines", async () => {
  const r = await build(k, { name: "nosuchpkg", steps: [{ type: "write_file", path: "/a", content: "a" }, { type: "apt_install", packages: ["nosuchpkg-xyz"] }] });
  assert.equal(r.status, 200);
  assert.equal(r.events.filter((e) => e.event === "retry").length, 0, "no retry for a package that does not exist");
  const last = r.events.at(-1)!;
  assert.equal(last.event, "error");
  const d = last.data.error_detail;
  assert.equal(d.code, "build_error");
  assert.equal(d.step_index, 2);
  assert.equal(d.retryable, false);
  assert.match(last.data.message, /^step 2\/2 \(apt_install nosuchpkg-xyz\) exited with code 100: .*Unable to locate package nosuchpkg-xyz/);
  assert.doesNotMatch(last.data.message, /attempts/);
  assert.match(d.suggested_action, /package name/);
  assert.equal(d.details.exit_code, 100);
  assert.ok(d.details.last_lines.some((l: string) => /Unable to locate package nosuchpkg-xyz/.test(l)), JSON.stringify(d.details.last_lines));
  assert.ok(d.details.last_lines.length <= 10);
  const rec = (await k.call("GET", "/v1/templates/nosuchpkg/builds")).body.builds[0];
  assert.equal(rec.status, "error");
});

test("kiln templates build says which step failed, why and what to do", async () => {
  const run = cliPipes(k.url, ["templates", "build", "--name", "failing-cli", "--run", "echo preparing; echo 'no such thing here' >&2; exit 4"]);
  assert.equal(await run.exited, 1);
  assert.match(run.stderr(), /failed in phase step at step 1: step 1\/1 \(run echo preparing.*\) exited with code 4: no such thing here/);
  assert.match(run.stderr(), /what to do: fix the command of this step/);
});
