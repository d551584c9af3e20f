// `kiln templates build|ls|builds|aliases|rm` as a person runs them against a real server.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtempSync, mkdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { machineFrom, sh } from "./support.ts";

const run = promisify(execFile);
const KILN = join(import.meta.dirname, "..", "..", "bin", "kiln");

let k: TestKiln;
let ctx: string;
before(async () => {
  // The user's files, made before the in-process server sets Kiln's private umask (077) for this whole process.
  ctx = mkdtempSync(join(tmpdir(), "kiln-cli-ctx-"));
  mkdirSync(join(ctx, "app"));
  writeFileSync(join(ctx, "app", "main.py"), "print('from the context')\n");
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => {
  await k?.close();
  rmSync(ctx, { recursive: true, force: true });
});

const cli = (args: string[]) => run(KILN, args, { env: { ...process.env, KILN_URL: k.url, KILN_API_KEY: TEST_KEY } });

test("kiln templates build streams the log with a progress line and prints the artifact id", async () => {
  const r = await cli(["templates", "build", "--name", "cli-built", "--alias", "cli-nick", "--env", "MODE=cli", "--context", ctx, "--copy", "app:/srv/app", "--run", "echo building now", "--tag", "v1"]);
  assert.match(r.stdout.trim(), /^art_/);
  assert.match(r.stderr, /building now/);
  assert.match(r.stderr, /\[step \d\/3 · cache hits \d+ · [\d.]+s\]/);
  const m = await machineFrom(k, "cli-built:v1");
  assert.equal((await sh(k, m, "python3 /srv/app/main.py; echo $MODE")).stdout, "from the context\ncli\n");
  const again = await cli(["templates", "build", "--name", "cli-built", "--alias", "cli-nick", "--env", "MODE=cli", "--context", ctx, "--copy", "app:/srv/app", "--run", "echo building now", "--tag", "v1"]);
  assert.equal(again.stdout, r.stdout, "a fully cached rebuild gives the same artifact");
  assert.match(again.stderr, /cache hit/);
});

test("kiln templates build exits non-zero when the build fails", async () => {
  await assert.rejects(cli(["templates", "build", "--name", "cli-broken", "--run", "exit 7"]), (err: { code?: number; stderr?: string }) => {
    assert.equal(err.code, 1);
    assert.match(err.stderr ?? "", /failed in phase step at step 1/);
    return true;
  });
  await assert.rejects(cli(["templates", "build", "--name", "x", "--tag", "bad tag"]), (err: { stderr?: string }) => /invalid_request/.test(err.stderr ?? ""));
});

test("kiln templates ls, builds, aliases and rm", async () => {
  assert.match((await cli(["templates", "ls"])).stdout, /local\/cli-built\ttpl_\S+\tv1=art_/);
  const builds = (await cli(["templates", "builds", "cli-built"])).stdout.trim().split("\n");
  assert.equal(builds.length, 2);
  assert.match(builds[0], /^bld_\S+\tready\tv1\t/);
  assert.match((await cli(["templates", "builds", "cli-broken"])).stdout, /\terror\(step\)\t/);
  assert.match((await cli(["templates", "aliases", "cli-built"])).stdout, /^local\/cli-nick\t/);
  assert.match((await cli(["templates", "rm", "cli-broken"])).stdout, /local\/cli-broken deleted/);
});
