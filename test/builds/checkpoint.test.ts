// The running state of a template's start command: under gVisor the build machine is checkpointed once start_cmd is
// ready and machines continue it (the same process, its in-memory counter going on); under runc every machine starts
// it at create. Either way create-time envs are invisible to it, and the build log says which of the two happened.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { TEST_RUNTIME } from "../support/paths.ts";
import { buildOk, machineFrom, sh } from "./support.ts";
import type { SseEvent } from "./support.ts";

// The counter lives in the shell's memory; each start records where it ran and what CREATE_ONLY it saw.
const SERVE = 'echo "$(hostname) ${CREATE_ONLY:-unset}" >> /srv/starts\ni=0\nwhile true; do i=$((i+1)); echo $i > /srv/count.tmp; mv /srv/count.tmp /srv/count; sleep 0.1; done\n';
const READY_AT = 15;

let k: TestKiln;
let built: { events: SseEvent[]; artifactId: string; buildId: string };

before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  built = await buildOk(k, {
    name: "counter",
    steps: [{ type: "write_file", path: "/srv/serve.sh", content: SERVE, mode: "0755" }, { type: "run", command: "chown user /srv" }],
    start_cmd: "/srv/serve.sh",
    ready_cmd: `test "$(cat /srv/count 2>/dev/null || echo 0)" -ge ${READY_AT}`,
  });
});

after(async () => {
  await k?.close();
});

const snapshotMessages = () => built.events.filter((e) => e.data.phase === "snapshot").map((e) => String(e.data.message));

test(`the build log says how machines get start_cmd's running state (${TEST_RUNTIME})`, () => {
  if (TEST_RUNTIME === "runsc") assert.ok(snapshotMessages().some((m) => /checkpointed under gVisor/.test(m)), snapshotMessages().join("\n"));
  else assert.ok(snapshotMessages().some((m) => /machines will start it at create/.test(m)), snapshotMessages().join("\n"));
});

test(`machines ${TEST_RUNTIME === "runsc" ? "continue the checkpointed start_cmd instead of re-running it" : "start start_cmd at create"}, without create-time envs`, async () => {
  const a = await machineFrom(k, "counter", { envs: { CREATE_ONLY: "create-time" } });
  const b = await machineFrom(k, "counter");
  for (const m of [a, b]) {
    // A shell forks before each command it runs; a child caught between fork and exec looks like the script itself,
    // so count only start commands whose parent is not one.
    const r = await sh(k, m, `cat /srv/starts; cat /srv/count; ps -eo pid=,ppid=,args= | awk '$3=="/bin/sh" && $4=="/srv/serve.sh" {p[$1]=$2} END {n=0; for (q in p) if (!(p[q] in p)) n++; print n}'; hostname`);
    const [starts, count, running, hostname, ...rest] = r.stdout.trim().split("\n");
    assert.equal(rest.length, 0, r.stdout);
    assert.equal(running, "1", "exactly one start command runs");
    assert.equal(hostname, m.replaceAll("_", "-"));
    // Started once, in the build machine, before any create-time env existed — or here, still without them.
    assert.equal(starts, TEST_RUNTIME === "runsc" ? "kiln-build unset" : `${hostname} unset`);
    assert.ok(Number(count) >= READY_AT, `the counter went on from its ready state: ${count}`);
    const later = await sh(k, m, `n=$(cat /srv/count); while [ "$(cat /srv/count)" -le "$n" ]; do sleep 0.05; done; cat /srv/count`);
    assert.ok(Number(later.stdout) > Number(count), "the counter keeps counting in the machine");
  }
  assert.equal((await sh(k, a, "echo $CREATE_ONLY")).stdout, "create-time\n", "create-time envs reach what runs after start_cmd");
  // Each machine continues on its own: a write in one is not seen in the other.
  await sh(k, a, "echo only-a > /srv/mine");
  assert.equal((await sh(k, b, "test -e /srv/mine && echo seen || echo unseen")).stdout, "unseen\n");
});

test("the checkpoint image is kept with the artifact's layers", { skip: TEST_RUNTIME !== "runsc" }, () => {
  assert.ok(existsSync(join(k.dataDir, "layers", `checkpoint-${built.buildId}`, "image")));
  assert.ok(existsSync(join(k.dataDir, "layers", `checkpoint-${built.buildId}`, "upper", "srv", "starts")));
});

test("retention removes a checkpoint with the artifact that names it", { skip: TEST_RUNTIME !== "runsc" }, async () => {
  const body = (n: string) => ({ name: "short-lived", steps: [{ type: "write_file", path: "/srv/n", content: n }], start_cmd: "sleep infinity" });
  const first = await buildOk(k, body("1"));
  const second = await buildOk(k, body("2"));
  const dir = (b: { buildId: string }) => join(k.dataDir, "layers", `checkpoint-${b.buildId}`);
  assert.ok(existsSync(dir(first)) && existsSync(dir(second)));
  await k.kiln.services.builds.collect(new Date(Date.now() + 30 * 86_400_000));
  assert.equal(existsSync(dir(first)), false, "the expired artifact's checkpoint is gone");
  assert.ok(existsSync(dir(second)), "the tagged artifact's checkpoint stays");
});
