// Every declarative step variant builds a real template that a machine then starts from and sees; build_envs reach
// the steps only; start_cmd runs in machines made from the template before create answers.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { startTestKiln } from "../support/kiln.ts";
import { TEST_RUNTIME } from "../support/paths.ts";
import type { TestKiln } from "../support/kiln.ts";
import { build, buildOk, machineFrom, putBlob, sh } from "./support.ts";
import type { SseEvent } from "./support.ts";
import { startFixtures } from "./fixtures.ts";
import type { Fixtures } from "./fixtures.ts";

const NASTY = `a'b"c$(touch /tmp/pwned)\`id\`\\n\\\\ \n;rm -rf / #`;
const MARKER = `kiln-build-env-marker-${randomBytes(8).toString("hex")}`;

let k: TestKiln;
let fx: Fixtures;
let built: { events: SseEvent[]; artifactId: string; buildId: string };
let machine: string;

before(async () => {
  fx = await startFixtures();
  k = await startTestKiln({ env: { KILN_MACHINE_HOST_ACCESS: "1", KILN_WARM_POOL: "0" } });
  const a = await putBlob(k, "alpha\n");
  const b = await putBlob(k, "beta\n");
  built = await buildOk(k, {
    name: "every-step",
    alias: "all-variants",
    build_envs: { KILN_MARKER: MARKER, PIP_INDEX_URL: `${fx.base}/simple`, PIP_TRUSTED_HOST: "host.kiln.internal" },
    context: { files: [{ path: "conf/a.txt", sha256: a }, { path: "conf/b.txt", sha256: b }] },
    runtime_defaults: { envs: { RUNTIME_DEFAULT: "yes" } },
    steps: [
      { type: "env", envs: { GREETING: "hello world" } },
      { type: "workdir", path: "/app" },
      { type: "copy", src: "conf/", dest: "/app/conf/", mode: "0640", owner: "user" },
      { type: "write_file", path: "/app/nasty.txt", content: NASTY },
      { type: "run", command: `echo "$GREETING" > greeting.txt; test "$KILN_MARKER" = "${MARKER}" && echo "marker seen: $KILN_MARKER"` },
      { type: "mkdir", path: "/data/cache", mode: "0700" },
      { type: "download", url: `${fx.base}/tool.sh`, dest: "/opt/tool.sh", sha256: fx.fileSha256, mode: "0755" },
      { type: "git_clone", url: `${fx.base}/repo.git`, dest: "/src/repo", branch: "main" },
      { type: "pip_install", packages: ["kilnpkg"] },
      { type: "apt_install", packages: ["jq"] },
      { type: "symlink", target: "/opt/tool.sh", path: "/usr/local/bin/tool" },
      { type: "rename", src: "/app/greeting.txt", dest: "/app/out/greeting.txt" },
      { type: "remove", path: "/app/conf/b.txt" },
      { type: "user", user: "user" },
      { type: "run", command: "whoami > /home/user/whoami-at-build" },
    ],
  });
  machine = await machineFrom(k, "every-step");
});
after(async () => {
  await k?.close();
  await fx?.close();
});

test("a machine started from the template sees the result of every step variant", async () => {
  const r = await sh(k, machine, [
    "echo \"$GREETING|$RUNTIME_DEFAULT|$(pwd)|$(whoami)\"",
    "cat /app/conf/a.txt; stat -c '%U %a' /app/conf/a.txt; test -e /app/conf/b.txt && echo b-still-there",
    "cat /app/out/greeting.txt",
    "stat -c '%a' /data/cache",
    "/usr/local/bin/tool; stat -c '%a' /opt/tool.sh",
    "cat /src/repo/README",
    "python3 -c 'import kilnpkg; print(kilnpkg.VALUE)'",
    "jq -n '1+1'",
    "cat /home/user/whoami-at-build",
    "test -e /tmp/pwned && echo pwned",
  ].join("; "));
  assert.equal(
    r.stdout,
    [
      "hello world|yes|/app|user",
      "alpha",
      "user 640",
      "hello world",
      "700",
      "downloaded tool",
      "755",
      "cloned from the local repo",
      "from the local index",
      "2",
      "user",
      "",
    ].join("\n"),
    r.stderr,
  );
  const nasty = await k.call("GET", `/v1/machines/${machine}/files?path=/app/nasty.txt`);
  assert.equal(nasty.text, NASTY, "write_file content arrives byte for byte");
});

test("step output streams as message entries of its step, with build_envs values redacted", () => {
  const seen = built.events.find((e) => e.event === "message" && e.data.message.startsWith("marker seen:"));
  assert.ok(seen, "the step's own output is in the log");
  assert.equal(seen.data.message, "marker seen: ***");
  assert.equal(seen.data.step_index, 5);
  assert.equal(seen.data.total_steps, 15);
  assert.equal(seen.data.phase, "step");
  const aptLines = built.events.filter((e) => e.event === "message" && e.data.step_index === 10 && e.data.phase === "step");
  assert.ok(aptLines.length > 3, "apt-get's lines stream as entries");
});

/** Machine and volume disk images are sparse files of gigabytes: their live files are searched where they are mounted. */
// Machines' disk images (in the reflink pool, `disks/` on `disks.xfs`) hold what machines wrote; the rest may not.
const DISK_IMAGES = ["--exclude=disk.img", "--exclude=image.ext4", "--exclude=disks.xfs", "--exclude-dir=disks"];

test("build_envs values appear nowhere: not in the machine, the data dir, the records or the server's logs", async () => {
  const r = await sh(k, machine, "echo ${KILN_MARKER:-unset}; env | grep -c host.kiln.internal || true");
  assert.equal(r.stdout, "unset\n0\n");
  const grep = (() => {
    try {
      return execFileSync("grep", ["-rls", "--binary-files=text", "--devices=skip", ...DISK_IMAGES, MARKER, k.dataDir]).toString();
    } catch (err) {
      // 1: no match; 2: some files could not be read (a netns bind mount), the matches are still printed.
      const e = err as { status?: number; stdout?: Buffer };
      if (e.status === 1 || e.status === 2) return e.stdout?.toString() ?? "";
      throw err;
    }
  })();
  assert.equal(grep, "", "no file under the data dir holds the marker");
  assert.ok(!k.logs.some((l) => l.includes(MARKER)), "no log line holds the marker");
  const history = await k.call("GET", "/v1/templates/every-step/builds");
  assert.ok(!history.text.includes(MARKER));
});

test("the alias resolves wherever a ref does, and is listed under the template's aliases", async () => {
  const list = await k.call("GET", "/v1/templates/refs/local/every-step/aliases");
  assert.equal(list.status, 200, list.text);
  assert.deepEqual(list.body.map((a: { alias_ref: string }) => a.alias_ref), ["local/all-variants"]);
  const m = await machineFrom(k, "all-variants");
  assert.equal((await sh(k, m, "cat /app/out/greeting.txt")).stdout, "hello world\n");
  const byAlias = await k.call("GET", "/v1/templates/all-variants/builds");
  assert.equal(byAlias.status, 200);
  assert.equal(byAlias.body.builds[0].build_id, built.buildId);
});

test("start_cmd runs in machines made from the template before create answers, without create-time envs", async () => {
  const b = await buildOk(k, {
    name: "with-start",
    steps: [{ type: "write_file", path: "/srv/serve.sh", content: "echo \"${CREATE_ONLY:-unset}\" > /tmp/start-env\nwhile true; do date +%s > /tmp/heartbeat; sleep 0.2; done\n", mode: "0755" }],
    start_cmd: "/srv/serve.sh",
    ready_cmd: "test -s /tmp/heartbeat",
  });
  const m = await machineFrom(k, "with-start", { envs: { CREATE_ONLY: "create-time" } });
  const r = await sh(k, m, "cat /tmp/start-env; test -s /tmp/heartbeat && echo ready; pgrep -f serve.sh >/dev/null && echo running; echo $CREATE_ONLY");
  assert.equal(r.stdout, "unset\nready\nrunning\ncreate-time\n");
  const phases = b.events.map((e) => e.data.phase);
  assert.ok(phases.includes("startup") && phases.includes("readiness"), "the build tried the start command");
  const way = TEST_RUNTIME === "runsc" ? /checkpointed under gVisor/ : /machines will start it at create/;
  assert.ok(b.events.some((e) => e.data.phase === "snapshot" && way.test(e.data.message)), "the log says which way machines get the running state");
});

test("a start command that does not stay up fails the build in phase readiness", async () => {
  const r = await build(k, { name: "bad-start", start_cmd: "echo bye" });
  const last = r.events.at(-1)!;
  assert.equal(last.event, "error");
  assert.equal(last.data.error_detail.code, "build_error");
  assert.equal(last.data.error_detail.phase, "readiness");
  assert.equal((await k.call("GET", "/v1/templates/bad-start/builds")).body.builds[0].failure_phase, "readiness");
});
