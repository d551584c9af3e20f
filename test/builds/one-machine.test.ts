// Declarative steps in one build machine (runc): the native backend over the real oci driver and the real base
// template. The steps of a build share one machine, each on a new upper dir swapped in under its agent, and the
// layers they leave are the same files as when every step boots its own machine (runsc, or a failed swap). Then a
// steps author attacks the swap: background writers, held fds and cwds, mounts, /proc, the host's layer dirs.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFile, execFileSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { existsSync, readFileSync } from "node:fs";
import { lstat, mkdtemp, readdir, readFile, readlink, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { createOciDriver } from "../../src/runtime/oci/driver.ts";
import type { MachineDriver } from "../../src/runtime/driver.ts";
import { prepareGuestRuntime } from "../../src/runtime/guest-runtime.ts";
import { ensureBaseTemplate } from "../../src/builder/base-template.ts";
import { bundleAgent, AGENT_SOURCES } from "../../src/agent/bundle.ts";
import { createLogger } from "../../src/log.ts";
import { createNativeBackend } from "../../src/builder/backends/native.ts";
import type { BuildBackend, BuildOutput } from "../../src/builder/backends/backend.ts";
import type { LayerCache } from "../../src/builder/cache/layers.ts";
import type { LogInput } from "../../src/builder/log.ts";
import { planSteps } from "../../src/builder/steps/index.ts";
import type { StepT } from "../../src/builder/steps/index.ts";
import { BuildFailure } from "../../src/builder/failure.ts";
import { createAgentClient } from "../../src/runtime/agent-client.ts";
import { TEST_CACHE_DIR } from "../support/paths.ts";
import { driverSkipReason, runtime } from "../support/runtime.ts";

const exec = promisify(execFile);
const skip = driverSkipReason();

const log = createLogger({ level: "warn", pretty: false });
let dataDir: string;
let base: { layerDir: string; digest: string };
let driver: MachineDriver;
let guestRuntimeDir: string;
/** Machines booted, by every backend of this file: one per build on runc, one per step on runsc. */
let boots = 0;

before(async () => {
  if (skip) return;
  base = await ensureBaseTemplate({ cacheDir: TEST_CACHE_DIR, log });
  guestRuntimeDir = await prepareGuestRuntime({ dir: join(TEST_CACHE_DIR, "guest-runtime"), agentBundle: bundleAgent, agentSources: AGENT_SOURCES });
  dataDir = await mkdtemp(join(tmpdir(), "kiln-steps-"));
  const real = createOciDriver({ dataDir, runtime, hostAccess: false, log, guestRuntimeDir });
  driver = { ...real, create: (spec) => (boots++, real.create(spec)) };
});

after(async () => {
  if (skip) return;
  await driver.close();
  await rm(dataDir, { recursive: true, force: true });
});

/** A layer cache in memory: the store's tier is tested elsewhere; here only what the backend asks of it. */
function memoryCache(): LayerCache {
  const entries = new Map<string, string | null>();
  return { lookup: async (key) => (entries.has(key) ? { dir: entries.get(key)! } : null), store: async (key, dir) => void entries.set(key, dir) };
}

/** Runs `steps` on the base template with the native backend over `d`; the log entries come back with the output. */
async function build(steps: StepT[], opts: { d?: MachineDriver; cache?: LayerCache; layersDir?: string; backend?: BuildBackend } = {}): Promise<{ out: BuildOutput; entries: LogInput[] }> {
  const entries: LogInput[] = [];
  const backend = opts.backend ?? createNativeBackend({ driver: opts.d ?? driver, layerCache: opts.cache ?? memoryCache(), layersDir: opts.layersDir ?? join(dataDir, "layers"), log, spare: false });
  const out = await backend.run({
    buildId: `bld_${randomBytes(6).toString("hex")}`,
    source: { type: "declarative", digest: base.digest, description: "local/base", layers: [{ dir: base.layerDir, digest: base.digest }], config: { env: {}, user: "root" } },
    steps: planSteps(steps, "root"),
    context: [],
    buildEnvs: {},
    vm: { vcpus: 1, memoryMb: 512, internet: false },
    skipCache: opts.cache === undefined,
    maxAttempts: 1,
    signal: new AbortController().signal,
    log: (e) => entries.push(e),
    count: () => undefined,
  });
  // A finished build's machine goes behind its answer: waited for here, so what it leaves can be looked at.
  await backend.settle?.();
  return { out, entries };
}

/** Every file of a layer as text: path, type, mode, owner, size, content digest or link target, device, xattrs (no times). */
async function tree(dir: string): Promise<string[]> {
  const out: string[] = [];
  const walk = async (rel: string) => {
    const path = join(dir, rel);
    const st = await lstat(path);
    let what = "";
    if (st.isFile()) what = createHash("sha256").update(await readFile(path)).digest("hex");
    else if (st.isSymbolicLink()) what = `-> ${await readlink(path)}`;
    else if (st.isCharacterDevice() || st.isBlockDevice()) what = `dev ${st.rdev}`;
    const { stdout } = await exec("getfattr", ["-h", "-d", "-m", "-", "--absolute-names", path]).catch(() => ({ stdout: "" }));
    // trusted.overlay.uuid names the overlay mount that wrote the dir (another in every boot), and origin the file
    // handle of the lower file copied up (in another layer dir for each build): only whether there is one compares.
    const xattrs = stdout
      .split("\n")
      .filter((l) => l && !l.startsWith("#") && !l.startsWith("trusted.overlay.uuid="))
      .map((l) => l.replace(/^trusted\.overlay\.origin=.*/, "trusted.overlay.origin"))
      .sort()
      .join(",");
    out.push(`${rel || "."} ${st.mode.toString(8)} ${st.uid}:${st.gid} ${st.isDirectory() ? "" : st.size} ${what} ${xattrs}`);
    if (st.isDirectory()) for (const name of (await readdir(path)).sort()) await walk(join(rel, name));
  };
  await walk("");
  return out;
}

/** The step's output lines (its RUN's stdout and stderr) in the build log. */
const output = (entries: LogInput[], step: number) => entries.filter((e) => e.kind === "message" && e.phase === "step" && e.step_index === step).map((e) => String(e.message));

/** The value after `tag=` in a step's output. */
const printed = (entries: LogInput[], step: number, tag: string) => output(entries, step).findLast((l) => l.startsWith(`${tag}=`))?.slice(tag.length + 1);

/** Machines, mounts and loop devices of this file's data dir still on the host. */
function leftovers(): string[] {
  // The spare disks the driver keeps ready (disk-stock) are its own, not a build's.
  const mounts = readFileSync("/proc/self/mountinfo", "utf8").split("\n").filter((l) => l.includes(dataDir) && !l.includes("/disk-stock/") && !l.includes("/disks/stock/"));
  const machines = existsSync(join(dataDir, "machines")) ? execFileSync("ls", [join(dataDir, "machines")], { encoding: "utf8" }).split("\n").filter(Boolean) : [];
  const loops = execFileSync("losetup", ["-a"], { encoding: "utf8" }).split("\n").filter((l) => l.includes(dataDir) && !l.includes("/disks/stock/"));
  return [...mounts.map((m) => `mount ${m}`), ...machines.map((m) => `machine ${m}`), ...loops.map((l) => `loop ${l}`)];
}

const mixed: StepT[] = [
  { type: "run", command: "mkdir -p /srv/app && echo one > /srv/app/one && ln -s one /srv/app/link && chmod 0750 /srv/app" },
  { type: "env", envs: { GREETING: "hello" } },
  { type: "workdir", path: "/srv/app" },
  { type: "run", command: 'echo "$GREETING from $(pwd)" > two && rm one && rm -rf /usr/share/doc && echo x > /etc/motd' },
  { type: "user", user: "user" },
  { type: "run", command: "id -un > /home/user/who && mkdir -p /home/user/cfg && echo 1 > /home/user/cfg/a" },
  { type: "user", user: "root" },
  { type: "run", command: "rm -rf /home/user/cfg && mkdir /home/user/cfg && echo 2 > /home/user/cfg/b && setfattr -n user.kiln -v yes /home/user/cfg/b 2>/dev/null; true" },
  { type: "write_file", path: "/srv/app/conf.json", content: '{"a":1}', mode: "0600" },
];

test("a build's steps run in one build machine, and leave the same layers as one machine per step", { skip }, async () => {
  const before = boots;
  const one = await build(mixed);
  const oneBoots = boots - before;
  const perStep = await build(mixed, { d: { ...driver, copyLayer: undefined, renewLayer: undefined } });
  const manyBoots = boots - before - oneBoots;
  assert.equal(manyBoots, 6, "without the swap every step that touches files boots a machine");
  assert.equal(oneBoots, runtime === "runc" ? 1 : 6, runtime === "runc" ? "on runc the 6 steps that touch files share one machine" : "runsc boots one per step");
  assert.deepEqual(
    one.out.layers.map((l) => l.digest),
    perStep.out.layers.map((l) => l.digest),
  );
  assert.deepEqual(one.out.config, perStep.out.config);
  for (let i = 0; i < one.out.layers.length; i++) assert.deepEqual(await tree(one.out.layers[i].dir), await tree(perStep.out.layers[i].dir), `layer ${i + 1} holds the same files`);
  // What the steps did is there: env, workdir, user and the whiteouts of what a step removed.
  const files = (await Promise.all(one.out.layers.map((l) => tree(l.dir)))).flat().join("\n");
  assert.match(files, /^srv\/app\/two /m);
  assert.match(files, /^usr\/share\/doc 20000 \S+ 0 dev 0 /m, "a removed lower dir is a whiteout");
  assert.equal(readFileSync(join(one.out.layers[2].dir, "srv/app/two"), "utf8"), "hello from /srv/app\n");
  assert.equal(readFileSync(join(one.out.layers[3].dir, "home/user/who"), "utf8"), "user\n");
  assert.ok(one.entries.some((e) => /runs in the build machine of the steps before it/.test(String(e.message))) === (runtime === "runc"));
  assert.deepEqual(leftovers(), []);
});

test("a step's background writer, held fd and cwd are gone before its layer is taken: nothing of it reaches the next step", { skip }, async () => {
  const { out, entries } = await build([
    {
      type: "run",
      command: [
        "mkdir -p /held",
        // A writer in its own session, and one holding an fd and a cwd in the root, both detached from the step.
        "setsid sh -c 'while :; do echo x >> /bg; done' </dev/null >/dev/null 2>&1 &",
        "setsid sh -c 'exec 3>>/held/fd; cd /held; while :; do echo y >&3; sleep 0.01; done' </dev/null >/dev/null 2>&1 &",
        "nohup sh -c 'trap \"\" TERM HUP; while :; do touch /late-$$; sleep 0.01; done' </dev/null >/dev/null 2>&1 &",
        "while [ ! -s /bg ] || [ ! -s /held/fd ]; do :; done",
      ].join("\n"),
    },
    { type: "run", command: 'sha256sum /bg /held/fd | sed "s/^/sum=/"; for p in /proc/[0-9]*; do echo "proc=$(tr "\\0" " " < $p/cmdline)"; done; ls / | grep -c "^late-" | sed "s/^/late=/"' },
    { type: "run", command: "sleep 0.3; true" },
  ]);
  const [first, second, third] = await Promise.all(out.layers.map((l) => tree(l.dir)));
  // What step 2 saw of step 1's files is exactly what step 1's layer holds: nothing was appended after its capture.
  const sums = output(entries, 2).filter((l) => l.startsWith("sum="));
  const layerSum = (rel: string) => createHash("sha256").update(readFileSync(join(out.layers[0].dir, rel))).digest("hex");
  assert.deepEqual(
    sums.map((l) => l.slice(4).split(/\s+/)[0]),
    [layerSum("bg"), layerSum("held/fd")],
  );
  assert.ok(first.some((l) => l.startsWith("bg ")));
  // No process of step 1 is there in step 2: only tini, the agent and step 2's own.
  const procs = output(entries, 2).filter((l) => l.startsWith("proc="));
  if (runtime === "runc") assert.ok(procs.every((l) => /tini|agent\.cjs|sha256sum|^proc=\/bin\/sh -c|^proc=$|tr |sed /.test(l)), procs.join("\n"));
  assert.ok(!procs.some((l) => /while|echo x|touch/.test(l)), procs.join("\n"));
  // Nothing of step 1 wrote into step 2's or step 3's layer.
  for (const layer of [second, third]) assert.ok(!layer.some((l) => /^(bg|held|late-)/.test(l)), layer.join("\n"));
  assert.deepEqual(leftovers(), []);
});

test("a step's stopped process, one in its own pid namespace and a double-forked one are gone before the next step: woken there, none writes", { skip: skip ?? (runtime !== "runc" && "runsc boots a machine per step") }, async () => {
  const { out, entries } = await build([
    {
      type: "run",
      command: [
        // Stopped by itself: were it left, the next step's `kill -CONT -1` would wake it to write into that step's layer.
        "sh -c 'kill -STOP $$; while :; do echo woke >> /stopped; sleep 0.01; done' </dev/null >/dev/null 2>&1 &",
        // In a pid namespace of its own (where the machine may make one), and double-forked away from the step's shell.
        "unshare -Urpf sh -c 'while :; do echo n >> /nested; sleep 0.01; done' </dev/null >/dev/null 2>&1 &",
        "sh -c '(while :; do echo d >> /double; sleep 0.01; done) &' </dev/null >/dev/null 2>&1",
        "while [ ! -s /double ]; do :; done",
        "for i in $(seq 50); do [ -s /nested ] && break; sleep 0.02; done",
        'echo "nested=$([ -s /nested ] && echo ran || echo refused)"',
      ].join("\n"),
    },
    { type: "run", command: "kill -CONT -1 2>/dev/null; sleep 0.3; ls / | sed 's/^/root=/'; true" },
    { type: "run", command: "sleep 0.3; true" },
  ]);
  assert.ok(["ran", "refused"].includes(printed(entries, 1, "nested") ?? ""), output(entries, 1).join("\n"));
  const roots = output(entries, 2).filter((l) => l.startsWith("root="));
  assert.ok(roots.includes("root=double"), roots.join(" ")); // step 1's file, seen from step 2 (the check sees what step 2 sees)
  assert.ok(!roots.includes("root=stopped"), "the stopped process did not wake in step 2");
  const [first, second, third] = await Promise.all(out.layers.map((l) => tree(l.dir)));
  assert.ok(first.some((l) => l.startsWith("double ")));
  for (const layer of [second, third]) assert.ok(!layer.some((l) => /^(stopped|nested|double)/.test(l)), layer.join("\n"));
  assert.deepEqual(leftovers(), []);
});

test("what a step leaves in memory (/dev, /dev/shm, /dev/mqueue, System V IPC) is gone in the next step, as in a machine of its own", { skip: skip ?? (runtime !== "runc" && "runsc boots a machine per step") }, async () => {
  const { entries } = await build([
    {
      type: "run",
      command: [
        "echo hidden > /dev/shm/x; mkdir -p /dev/shm/d/e; echo deep > /dev/shm/d/e/f; ln -s /etc /dev/shm/link",
        // /dev itself is the runtime's tmpfs, not the overlay: a file, a dir, and a runtime link replaced by a file.
        "echo hidden > /dev/hidden; mkdir /dev/dd; ln -s /etc /dev/etc; rm /dev/stdout; echo no > /dev/stdout",
        "ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null && ipcmk -S 1 >/dev/null",
        'echo "ipc=$(ipcs | grep -c ^0x)"; echo "shm=$(ls -A /dev/shm | wc -l)"',
      ].join("\n"),
    },
    {
      type: "run",
      command: [
        'echo "ipc=$(ipcs | grep -c ^0x)"; echo "shm=$(ls -A /dev/shm | wc -l)"; echo "mq=$(ls -A /dev/mqueue 2>/dev/null | wc -l)"; ls /etc/hostname >/dev/null && echo etc=kept',
        'echo "dev=$(ls -A /dev | tr "\\n" " ")"; echo "stdout=$(stat -c %F /dev/stdout 2>/dev/null || echo none)"',
      ].join("\n"),
    },
  ]);
  assert.equal(printed(entries, 1, "ipc"), "3", output(entries, 1).join("\n"));
  assert.equal(printed(entries, 1, "shm"), "3", output(entries, 1).join("\n"));
  assert.equal(printed(entries, 2, "ipc"), "0", "no System V object of step 1 in step 2");
  assert.equal(printed(entries, 2, "shm"), "0", "no file of step 1's /dev/shm in step 2");
  assert.equal(printed(entries, 2, "mq"), "0");
  assert.equal(printed(entries, 2, "etc"), "kept", "a link in /dev/shm is removed, not followed");
  // The runtime's entries only; the link step 1 replaced by a file is gone (not made again: see clearDev).
  assert.equal(printed(entries, 2, "dev"), "fd full mqueue null ptmx pts random shm stderr stdin tty urandom zero ", "/dev holds the runtime's entries only");
  assert.equal(printed(entries, 2, "stdout"), "none", "the file step 1 put in place of a runtime link is gone");
  assert.deepEqual(leftovers(), []);
});

test("a step cannot leave a mount, a /proc change or a way to the host's layer dirs for the next one", { skip }, async () => {
  const canary = `canary-${randomBytes(6).toString("hex")}`;
  const layersDir = join(dataDir, "layers-canary");
  const { mkdir } = await import("node:fs/promises");
  await mkdir(layersDir, { recursive: true });
  await writeFile(join(layersDir, canary), "host");
  const { entries, out } = await build(
    [
      {
        type: "run",
        command: [
          "mount -t tmpfs tmpfs /mnt 2>/dev/null && echo mount=made || echo mount=refused",
          "echo 900 > /proc/self/oom_score_adj; echo comm > /proc/self/comm",
          // Ways out of the root the swap might follow: mount points' parents turned into links to elsewhere.
          "ln -s /proc/1/root/.. /escape; ln -s ../../../../.. /srv/up",
          "mv /etc/hostname /etc/hostname.old 2>/dev/null; ln -sf /proc/1/root /etc/hostname 2>/dev/null; true",
          "mkdir -p /opt/x; ln -s / /opt/x/root; true",
        ].join("\n"),
      },
      {
        type: "run",
        command: [
          "grep -c ' /mnt ' /proc/self/mountinfo | sed 's/^/mnt=/'",
          'echo "adj=$(cat /proc/self/oom_score_adj)"',
          `echo "found=$(find / /escape/ /srv/up/ -xdev -name ${canary} 2>/dev/null | head -1)"`,
          `echo "lowers=$(grep -o 'lowerdir=[^,]*' /proc/self/mountinfo | head -1)"`,
        ].join("\n"),
      },
    ],
    { layersDir },
  );
  assert.ok(["made", "refused"].includes(printed(entries, 1, "mount") ?? ""), output(entries, 1).join("\n"));
  assert.equal(printed(entries, 2, "mnt"), "0", "no mount of step 1 is in step 2");
  assert.notEqual(printed(entries, 2, "adj"), "900", "step 2's processes start as the agent starts them, not as step 1 left itself");
  assert.equal(printed(entries, 2, "found"), "", "the host's layer dirs are out of reach");
  assert.ok(!(printed(entries, 2, "lowers") ?? "").includes(layersDir), "the machine does not see the host's layer paths");
  assert.equal(out.layers.length, 2);
  assert.deepEqual(leftovers(), []);
});

test("a cached prefix resumes in one machine; a failing step leaves nothing behind", { skip }, async () => {
  const cache = memoryCache();
  const steps: StepT[] = [
    { type: "run", command: "echo a > /a" },
    { type: "run", command: "echo b > /b" },
  ];
  await build(steps, { cache });
  const before = boots;
  const { out, entries } = await build([...steps, { type: "run", command: "cat /a /b > /c" }, { type: "run", command: "rm /a && cat /c > /d" }], { cache });
  assert.equal(boots - before, runtime === "runc" ? 1 : 2, "on runc the two steps after the cached ones share one machine");
  assert.equal(entries.filter((e) => e.kind === "cache" && e.cache_outcome === "hit").length, 2);
  assert.equal(readFileSync(join(out.layers[3].dir, "d"), "utf8"), "a\nb\n");
  await assert.rejects(build([{ type: "run", command: "echo ok > /ok" }, { type: "run", command: "sleep 1000 >/dev/null 2>&1 & exit 3" }]), (err: unknown) => err instanceof BuildFailure && err.stepIndex === 2);
  assert.deepEqual(leftovers(), []);
});

test("after a build, the next one's machine is booted ahead of time: its first step boots nothing and leaves the same layers", { skip }, async () => {
  const backend = createNativeBackend({ driver, layerCache: memoryCache(), layersDir: join(dataDir, "layers"), log });
  try {
    await build([{ type: "run", command: "echo first > /first" }], { backend });
    const { out, entries } = await build(mixed, { backend });
    const booted = entries.filter((e) => /starting a build machine/.test(String(e.message))).length;
    const ahead = entries.some((e) => /booted ahead of time/.test(String(e.message)));
    assert.equal(booted, runtime === "runc" ? 0 : 6, "on runc the build boots no machine of its own");
    assert.equal(ahead, runtime === "runc");
    const perStep = await build(mixed, { d: { ...driver, copyLayer: undefined, renewLayer: undefined } });
    for (let i = 0; i < out.layers.length; i++) assert.deepEqual(await tree(out.layers[i].dir), await tree(perStep.out.layers[i].dir), `layer ${i + 1} holds the same files`);
    assert.ok(!out.layers.some((l) => existsSync(join(l.dir, "first"))), "nothing of the build before is in its layers");
  } finally {
    await backend.close?.();
  }
  assert.deepEqual(leftovers(), []);
});

test("a build machine a crash left mid-build (its root renewed, a step's process running) is removed by the next start's sweep", { skip: skip ?? (runtime !== "runc" && "runsc boots a machine per step") }, async () => {
  const id = `mch_t${process.pid}crash`;
  const live = await driver.create({ id, layers: [base.layerDir], hostname: "kiln-build", vcpus: 1, memoryMb: 256, internet: true, mounts: [] });
  const agent = createAgentClient(live.agentSocket);
  try {
    assert.equal((await agent.exec({ cmd: "echo a > /a", timeout_ms: 20_000 })).exit_code, 0);
    const first = join(dataDir, "crash-layer");
    await driver.copyLayer!(id, first);
    await driver.renewLayer!(id, [base.layerDir, first]);
    const r = await agent.exec({ cmd: "cat /a && setsid sh -c 'while :; do echo b >> /b; sleep 0.01; done' </dev/null >/dev/null 2>&1 &", timeout_ms: 20_000 });
    assert.equal(Buffer.from(r.stdout_base64, "base64").toString(), "a\n");
  } finally {
    await agent.close();
  }
  // The next start's driver knows nothing of it but its dir: the sweep (machines/adoption.ts) destroys it as a leftover.
  const next = createOciDriver({ dataDir, runtime, hostAccess: false, log, guestRuntimeDir });
  assert.ok((await next.listKnown!()).includes(id));
  await next.destroy(id, { leftover: true });
  assert.deepEqual(leftovers(), []);
  for (const c of ["freezer", "memory", "pids", "cpu"]) assert.ok(!existsSync(`/sys/fs/cgroup/${c}/kiln/${id}`), `no ${c} cgroup left`);
});
