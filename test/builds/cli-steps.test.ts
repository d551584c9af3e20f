// `kiln templates build` has a flag for every declarative step kind, a Dockerfile and the build machine's limits
// (issue 24, item 7): the flags make the request the docs describe, in the order given, and a build from flags
// alone gives machines the result of each step.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { cliPipes } from "../support/cli.ts";
import { machineFrom, sh } from "./support.ts";
import { startFixtures } from "./fixtures.ts";
import type { Fixtures } from "./fixtures.ts";

let k: TestKiln;
let fx: Fixtures;
let dir: string;
before(async () => {
  fx = await startFixtures();
  k = await startTestKiln({ env: { KILN_MACHINE_HOST_ACCESS: "1", KILN_WARM_POOL: "0" } });
  dir = await mkdtemp(join(tmpdir(), "kiln-cli-steps-"));
});
after(async () => {
  await k?.close();
  await fx?.close();
  if (dir) await rm(dir, { recursive: true, force: true });
});

async function kiln(args: string[]) {
  const run = cliPipes(k.url, args);
  run.end();
  const code = await run.exited;
  return { code, stdout: run.stdout(), stderr: run.stderr() };
}

test("every declarative step kind has a flag, and the steps come in the order the flags are given", async () => {
  await writeFile(join(dir, "motd"), "from a local file\n");
  await writeFile(join(dir, "Dockerfile"), "FROM local/base\nRUN echo hi\n");
  const r = await kiln([
    "templates", "build", "--dry-run", "-n", "flags",
    "--user", "root", "--env", "A=1", "--env", "B=2", "--workdir", "/app", "--copy", "conf/:/app/conf/",
    "--apt", "jq", "--apt", "tree", "--pip", "requests", "--npm", "left-pad", "--npm-global", "typescript",
    "--git-clone", "/src/repo=http://git.example/repo.git#main", "--download", "/opt/t.sh=http://files.example/t.sh#sha256=" + "a".repeat(64),
    "--write-file", "/etc/motd=@" + join(dir, "motd"), "--write-file", "/app/x=a=b", "--mkdir", "/data", "--remove", "/tmp/junk",
    "--rename", "/app/x:/app/y", "--symlink", "/usr/local/bin/t:/opt/t.sh", "--run", "echo last",
    "--vcpus", "2", "--memory", "2048", "--no-internet", "--tag", "v1",
  ]);
  assert.equal(r.code, 0, r.stderr);
  const body = JSON.parse(r.stdout);
  assert.deepEqual(body.steps, [
    { type: "user", user: "root" },
    { type: "env", envs: { A: "1", B: "2" } },
    { type: "workdir", path: "/app" },
    { type: "copy", src: "conf/", dest: "/app/conf/" },
    { type: "apt_install", packages: ["jq", "tree"] },
    { type: "pip_install", packages: ["requests"] },
    { type: "npm_install", packages: ["left-pad"] },
    { type: "npm_install", packages: ["typescript"], global: true },
    { type: "git_clone", url: "http://git.example/repo.git", dest: "/src/repo", branch: "main" },
    { type: "download", url: "http://files.example/t.sh", dest: "/opt/t.sh", sha256: "a".repeat(64) },
    { type: "write_file", path: "/etc/motd", content: "from a local file\n" },
    { type: "write_file", path: "/app/x", content: "a=b" },
    { type: "mkdir", path: "/data" },
    { type: "remove", path: "/tmp/junk", recursive: true },
    { type: "rename", src: "/app/x", dest: "/app/y" },
    { type: "symlink", path: "/usr/local/bin/t", target: "/opt/t.sh" },
    { type: "run", command: "echo last" },
  ]);
  const kinds = new Set(body.steps.map((s: { type: string }) => s.type));
  assert.equal(kinds.size, 15, "all 15 kinds");
  assert.deepEqual(body.vm, { vcpus: 2, memory_mb: 2048, internet: false });
  assert.deepEqual(body.tags, ["v1"]);

  const df = await kiln(["templates", "build", "--dry-run", "-n", "df", "--dockerfile", join(dir, "Dockerfile")]);
  assert.equal(JSON.parse(df.stdout).dockerfile, "FROM local/base\nRUN echo hi\n");
  const bad = await kiln(["templates", "build", "--dry-run", "--rename", "nocolon"]);
  assert.equal(bad.code, 1);
  assert.match(bad.stderr, /--rename takes src:dest/);
});

test("a template built from step flags alone gives machines the result of each step", async () => {
  const r = await kiln([
    "templates", "build", "-n", "from-flags",
    "--download", `/opt/tool.sh=${fx.base}/tool.sh#sha256=${fx.fileSha256}`,
    "--git-clone", `/src/repo=${fx.base}/repo.git#main`,
    "--write-file", "/etc/kiln-motd=hello", "--mkdir", "/data/cache", "--symlink", "/usr/local/bin/tool:/opt/tool.sh",
    "--write-file", "/tmp/old=x", "--rename", "/tmp/old:/tmp/new", "--write-file", "/tmp/gone=x", "--remove", "/tmp/gone",
    "--user", "user", "--run", "whoami > /home/user/who",
  ]);
  assert.equal(r.code, 0, r.stderr);
  assert.match(r.stdout.trim(), /^art_/);
  const m = await machineFrom(k, "from-flags");
  const out = await sh(k, m, "cat /opt/tool.sh | head -c 0; test -d /src/repo/.git && echo cloned; cat /etc/kiln-motd; echo; test -d /data/cache && echo dir; readlink /usr/local/bin/tool; cat /tmp/new; test -e /tmp/gone || echo removed; cat /home/user/who");
  assert.equal(out.stdout, "cloned\nhello\ndir\n/opt/tool.sh\nxremoved\nuser\n");
});
