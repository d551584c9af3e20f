// The oci driver on the real runtime (runc unless KILN_OCI_RUNTIME says runsc) over the real base template:
// isolation, copy-on-write roots, limits, network modes, hibernate/resume, destroy and adoption after a restart.
// Both runtimes run every test; commands run in the machine through its agent, as users' commands do.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { existsSync, readFileSync, statSync } from "node:fs";
import { mkdtemp, mkdir, rm, writeFile } from "node:fs/promises";
import { createServer } from "node:net";
import type { Server } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { createOciDriver, containerName, HOST_ID_BASE } from "../../src/runtime/oci/driver.ts";
import { writableLayer } from "../../src/runtime/oci/disk.ts";
import type { LiveMachine, MachineDriver, MachineSpec } from "../../src/runtime/driver.ts";
import { prepareGuestRuntime } from "../../src/runtime/guest-runtime.ts";
import { ensureBaseTemplate } from "../../src/builder/base-template.ts";
import { bundleAgent, AGENT_SOURCES } from "../../src/agent/bundle.ts";
import { createLogger } from "../../src/log.ts";
import { createAgentClient } from "../../src/runtime/agent-client.ts";
import type { AgentClient } from "../../src/runtime/agent-client.ts";
import { TEST_CACHE_DIR } from "../support/paths.ts";
import { driverSkipReason, runtime } from "../support/runtime.ts";

const exec = promisify(execFile);
const skip = driverSkipReason();
if (skip) process.stderr.write(`skipping the oci driver tests: ${skip}\n`);

const log = createLogger({ level: "warn", pretty: false });
let dataDir: string;
let layer: string;
let guestRuntimeDir: string;
let driver: MachineDriver;
const created = new Set<string>();

before(async () => {
  if (skip) return;
  layer = (await ensureBaseTemplate({ cacheDir: TEST_CACHE_DIR, log })).layerDir;
  guestRuntimeDir = await prepareGuestRuntime({ dir: join(TEST_CACHE_DIR, "guest-runtime"), agentBundle: bundleAgent, agentSources: AGENT_SOURCES });
  dataDir = await mkdtemp(join(tmpdir(), "kiln-oci-"));
  driver = newDriver();
});

after(async () => {
  if (skip) return;
  await Promise.all([...agents.values()].map((a) => a.close()));
  await Promise.all([...created].map((id) => driver.destroy(id)));
  await rm(dataDir, { recursive: true, force: true });
});

function newDriver(extra: { hostAccess?: boolean; guestRuntimeDir?: string } = {}) {
  return createOciDriver({ dataDir, runtime, hostAccess: extra.hostAccess ?? false, log, guestRuntimeDir: extra.guestRuntimeDir ?? guestRuntimeDir });
}

let seq = 0;
async function machine(over: Partial<MachineSpec> = {}, d = driver): Promise<LiveMachine> {
  const id = `mch_t${process.pid}x${++seq}`;
  created.add(id);
  return d.create({ id, layers: [layer], hostname: id.replaceAll("_", "-"), vcpus: 1, memoryMb: 256, diskMb: 1024, internet: false, mounts: [], ...over });
}

const agents = new Map<string, AgentClient>();

/** Runs a shell line as machine root through the machine's agent; a non-zero exit fails with its stderr. */
async function sh(m: LiveMachine, line: string): Promise<string> {
  let agent = agents.get(m.agentSocket);
  if (!agent) agents.set(m.agentSocket, (agent = createAgentClient(m.agentSocket)));
  const r = await agent.exec({ cmd: line, timeout_ms: 20_000 });
  const out = Buffer.from(r.stdout_base64, "base64").toString();
  if (r.exit_code !== 0) throw new Error(`${JSON.stringify(line)} exited ${r.exit_code ?? r.signal}: ${Buffer.from(r.stderr_base64, "base64").toString()}`);
  return out;
}

const opt = { skip };

/** The machine's network interfaces, from /proc/net/dev (gVisor has no /sys/class/net). */
async function interfaces(m: LiveMachine): Promise<string[]> {
  const dev = await sh(m, "cat /proc/net/dev");
  return dev.split("\n").slice(2).map((l) => l.split(":")[0].trim()).filter(Boolean).sort();
}

/** A killed machine's first process is reaped by the host's init, not by us: allow it a moment. */
async function gone(pid: number): Promise<boolean> {
  for (let i = 0; i < 100; i++) {
    const stat = existsSync(`/proc/${pid}/stat`) ? readFileSync(`/proc/${pid}/stat`, "utf8").replace(/^.*\) /, "") : "";
    if (!stat || stat.startsWith("Z")) return true;
    await new Promise((r) => setTimeout(r, 20));
  }
  return false;
}

test("a machine has its own pid 1 (tini), hostname and process table", opt, async () => {
  const m = await machine();
  const pid1 = (await sh(m, "tr '\\0' ' ' < /proc/1/cmdline")).trim();
  const listen = runtime === "runc" ? "--listen-fd 3" : "--socket /run/kiln/agent.sock";
  // runc: tini and the agent's loader are the exec-only copies (neither process is dumpable; see guest-runtime.ts).
  const start = runtime === "runc" ? "/opt/kiln/exec-only/tini -s -- /opt/kiln/exec-only/ld\\.so" : "/opt/kiln/bin/tini -s -- /opt/kiln/lib/ld-linux[^ ]*";
  assert.match(pid1, new RegExp(`^${start} --library-path /opt/kiln/lib /opt/kiln/bin/node /opt/kiln/agent/agent\\.cjs ${listen}`));
  if (runtime === "runc") {
    // The agent's socket is handed in as a file descriptor: no path inside the machine could be swapped for a symlink.
    assert.equal((await sh(m, "test -e /run/kiln/agent.sock && echo visible || echo absent")).trim(), "absent");
  } else {
    // runsc binds a directory for it, locked once the agent listens: machine root cannot swap the socket.
    const swap = await sh(m, "ln -sf /tmp/elsewhere /run/kiln/agent.sock 2>&1; echo rc=$?; rm -f /run/kiln/agent.sock 2>&1; echo rc=$?");
    assert.match(swap, /rc=1[\s\S]*rc=1/);
    assert.ok(statSync(m.agentSocket).isSocket(), "the host still sees the agent's socket");
  }
  assert.equal((await sh(m, "hostname")).trim(), m.id.replaceAll("_", "-"));
  assert.equal((await sh(m, "cat /etc/hostname")).trim(), m.id.replaceAll("_", "-"));
  const pids = (await sh(m, "ls /proc | grep -c '^[0-9]'")).trim();
  assert.ok(Number(pids) < 10, `only the machine's own processes are visible (saw ${pids})`);
  assert.equal((await sh(m, "test -e /work/main && echo visible || echo hidden")).trim(), "hidden");
  assert.ok(existsSync(m.agentSocket), "the agent socket is on the host at agentSocket");
});

test("machine root is an unprivileged host uid, with reduced capabilities, no_new_privs and seccomp", opt, async () => {
  const m = await machine();
  const status = readFileSync(`/proc/${m.pid}/status`, "utf8");
  const [, real, effective] = /^Uid:\s+(\d+)\s+(\d+)/m.exec(status)!;
  const [first, base, size] = readFileSync(`/proc/${m.pid}/uid_map`, "utf8").trim().split(/\s+/).map(Number);
  assert.deepEqual([first, size], [0, 65536]);
  // Its own range from the pool where the host has idmapped mounts (this one does), the shared one elsewhere.
  if ((await driver.readiness()).identity.uid_ranges === "per-machine") assert.ok(base > HOST_ID_BASE && (base - HOST_ID_BASE) % 65536 === 0, `machine root is host uid ${base}`);
  else assert.equal(base, HOST_ID_BASE);
  assert.equal(Number(real), base);
  assert.equal(Number(effective), base);
  // gVisor's /proc has no NoNewPrivs line: ask prctl(PR_GET_NO_NEW_PRIVS) in both.
  const inside = await sh(m, "id -u; grep -E '^(CapEff|Seccomp):' /proc/self/status; python3 -c 'import ctypes; print(\"NoNewPrivs:\", ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))'");
  assert.match(inside, /^0\n/);
  assert.match(inside, /NoNewPrivs:\s+1/);
  assert.match(inside, /Seccomp:\s+2/);
  const capEff = BigInt("0x" + /CapEff:\s+(\S+)/.exec(inside)![1]);
  assert.equal(capEff & (1n << 21n), 0n, "no CAP_SYS_ADMIN");
  // A nested user namespace is refused by the seccomp profile; clone3 answers ENOSYS so libc falls back to clone.
  assert.match(await sh(m, "unshare -U true 2>&1; echo rc=$?"), /Operation not permitted[\s\S]*rc=1/);
  assert.equal((await sh(m, "python3 -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.syscall(435, 0, 0), ctypes.get_errno())'")).trim(), "-1 38");
});

test("writes land in the machine's upper dir, never in the template layer, and /opt/kiln is read-only", opt, async () => {
  const a = await machine();
  const b = await machine();
  await sh(a, "echo from-a > /etc/kiln-marker && rm /etc/debian_version");
  assert.equal(await sh(a, "cat /etc/kiln-marker"), "from-a\n");
  assert.equal((await sh(b, "test -e /etc/kiln-marker && echo seen || echo unseen; cat /etc/debian_version >/dev/null && echo kept")).trim(), "unseen\nkept");
  assert.ok(!existsSync(join(layer, "etc/kiln-marker")), "the template layer is untouched");
  assert.ok(existsSync(join(layer, "etc/debian_version")), "a delete in one machine is a whiteout in its upper dir");
  assert.ok(existsSync(join(writableLayer(join(dataDir, "machines", a.id)).upper, "etc/kiln-marker")));
  assert.match(await sh(a, "touch /opt/kiln/x 2>&1; echo rc=$?"), /Read-only file system[\s\S]*rc=1/);
  assert.equal((await sh(a, "stat -c %U:%u /workspace /home/user /etc/passwd")).trim(), "user:1000\nuser:1000\nroot:0");
});

test("cgroup limits for cpu, memory and pids are what the spec asked, and readiness says what is enforced", opt, async () => {
  const m = await machine({ vcpus: 2, memoryMb: 300 });
  const ready = await driver.readiness();
  assert.equal(ready.ready, true, ready.detail);
  assert.ok(["v1", "v2", "hybrid"].includes(ready.cgroup.version));
  const read = (v1: string, v2: string) => {
    const file = ready.cgroup.version === "v2" ? `/sys/fs/cgroup/kiln/${m.id}/${v2}` : `/sys/fs/cgroup/${v1}`.replace("<id>", m.id);
    return readFileSync(file, "utf8").trim();
  };
  for (const c of ["cpu", "memory", "pids"]) assert.ok(ready.cgroup.enforced.includes(c), `${c} is enforced on this host`);
  if (ready.cgroup.version === "v2") {
    assert.equal(read("", "memory.max"), String(300 * 1024 * 1024));
    assert.equal(read("", "cpu.max"), "200000 100000");
    assert.equal(read("", "pids.max"), "4096");
  } else {
    assert.equal(read("memory/kiln/<id>/memory.limit_in_bytes", ""), String(300 * 1024 * 1024));
    assert.equal(read("cpu/kiln/<id>/cpu.cfs_quota_us", ""), "200000");
    assert.equal(read("pids/kiln/<id>/pids.max", ""), "4096");
  }
});

test("internet: false leaves loopback only, and it is up", opt, async () => {
  const m = await machine({ internet: false });
  assert.deepEqual(await interfaces(m), ["lo"]);
  const echo = "import socket; s = socket.create_server(('127.0.0.1', 0)); c = socket.create_connection(s.getsockname()); a, _ = s.accept(); c.sendall(b'up'); print(a.recv(2).decode())";
  assert.equal((await sh(m, `python3 -c "${echo}"`)).trim(), "up", "loopback carries traffic");
  assert.equal((await sh(m, "cat /etc/resolv.conf")).trim(), "");
});

test("runc: the loopback acknowledges at once (quickack on its local routes), with internet or without", opt, async (t) => {
  if (runtime !== "runc") return t.skip("gVisor's own network stack serves a runsc machine's loopback");
  // Without it, a service that sends an answer's head and body apart waits ~40 ms for the agent's delayed ACK.
  for (const internet of [false, true]) {
    if (internet && !existsSync("/usr/bin/slirp4netns")) continue;
    const m = await machine({ internet });
    const { stdout } = await exec("nsenter", [`--net=/proc/${m.pid}/ns/net`, "ip", "route", "show", "table", "local"]);
    for (const dst of ["127.0.0.1", "127.0.0.0/8"]) assert.match(stdout, new RegExp(`^local ${dst.replace(/\./g, "\\.")} .*quickack 1`, "m"), stdout);
  }
});

test("internet: true attaches slirp4netns (killed on destroy); host loopback only with host access", opt, async (t) => {
  if (!existsSync("/usr/bin/slirp4netns")) return t.skip("slirp4netns is not installed");
  const server: Server = createServer((s) => s.end("hello from the host\n"));
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const port = (server.address() as { port: number }).port;
  try {
    const probe = `timeout 3 bash -c 'exec 3<>/dev/tcp/10.0.2.2/${port}; cat <&3' 2>/dev/null || echo unreachable`;
    const closed = await machine({ internet: true });
    assert.deepEqual(await interfaces(closed), ["lo", "tap0"]);
    assert.equal((await sh(closed, "cat /etc/resolv.conf")).trim().split("\n")[0], "nameserver 10.0.2.3");
    assert.equal((await sh(closed, probe)).trim(), "unreachable");
    const slirpPid = Number(readFileSync(join(dataDir, "machines", closed.id, "slirp.pid"), "utf8"));
    assert.ok(existsSync(`/proc/${slirpPid}`));
    await driver.destroy(closed.id);
    await new Promise((r) => setTimeout(r, 100));
    assert.ok(!existsSync(`/proc/${slirpPid}`) || !readFileSync(`/proc/${slirpPid}/cmdline`, "utf8").startsWith("slirp4netns"), "slirp4netns is gone");
    assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(closed.id), "no network namespace file is left mounted");

    const open = await machine({ internet: true }, newDriver({ hostAccess: true }));
    assert.match(await sh(open, "grep host.kiln.internal /etc/hosts"), /^10\.0\.2\.2\s+host\.kiln\.internal/);
    assert.equal((await sh(open, probe.replace("10.0.2.2", "host.kiln.internal"))).trim(), "hello from the host");
  } finally {
    server.close();
  }
});

test("hibernate freezes every process in place and resume thaws them", opt, async () => {
  const m = await machine();
  // A loop logs the wall clock (ms) every 20 ms; the log is read through the agent once the machine runs again.
  await sh(m, "while :; do date +%s%3N >> /tmp/ticks; sleep 0.02; done >/dev/null 2>&1 &");
  await new Promise((r) => setTimeout(r, 200));
  await driver.hibernate(m.id);
  const frozenAt = Date.now();
  assert.equal((await driver.listLive()).find((l) => l.id === m.id)?.state, "paused");
  await new Promise((r) => setTimeout(r, 400));
  const thawedAt = Date.now();
  const back = await driver.resume(m.id);
  assert.equal(back.state, "running");
  assert.equal(back.agentSocket, m.agentSocket);
  await new Promise((r) => setTimeout(r, 300));
  const ticks = (await sh(m, "cat /tmp/ticks")).trim().split("\n").map(Number);
  assert.ok(ticks.some((t) => t < frozenAt), "the loop ran before hibernate");
  assert.deepEqual(ticks.filter((t) => t > frozenAt + 50 && t < thawedAt), [], "nothing ran while hibernated");
  assert.ok(ticks.filter((t) => t >= thawedAt).length >= 3, "processes run again after resume");
});

test("stop keeps the machine's root; start boots it again with its files", opt, async () => {
  const m = await machine();
  await sh(m, "echo kept > /root/note");
  await driver.stop(m.id);
  assert.equal((await driver.listLive()).some((l) => l.id === m.id), false);
  const again = await driver.start(m.id);
  assert.notEqual(again.pid, m.pid);
  assert.equal(await sh(m, "cat /root/note"), "kept\n");
});

test("destroy leaves no process, mount, cgroup or directory behind, and is idempotent (also when hibernated)", opt, async () => {
  const a = await machine();
  const b = await machine();
  await driver.hibernate(b.id);
  for (const m of [a, b]) {
    await driver.destroy(m.id);
    await driver.destroy(m.id);
    created.delete(m.id);
    const dir = join(dataDir, "machines", m.id);
    assert.ok(!existsSync(dir), "machine dir removed");
    assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(dir), "no mount left");
    assert.ok(await gone(m.pid), "first process gone");
    assert.ok(!existsSync(`/sys/fs/cgroup/memory/kiln/${m.id}`) && !existsSync(`/sys/fs/cgroup/kiln/${m.id}`), "cgroup removed");
    assert.equal((await driver.listLive()).some((l) => l.id === m.id), false);
  }
  await driver.destroy("mch_never_existed");
});

test("destroy also cleans up after a crash halfway (runtime state gone, mount and dir left)", opt, async () => {
  const m = await machine();
  // Simulate a control plane that died after killing the container but before unmounting and removing.
  await exec(runtime, ["--root", join(dataDir, "oci-state", runtime), "delete", "--force", containerName(runtime, m.id)]);
  const dir = join(dataDir, "machines", m.id);
  assert.ok(readFileSync("/proc/self/mountinfo", "utf8").includes(join(dir, "rootfs")));
  await driver.destroy(m.id);
  created.delete(m.id);
  assert.ok(!existsSync(dir));
  assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(dir));
});

test("a new driver over the same data dir (a restarted control plane) lists the live machines", opt, async () => {
  const running = await machine();
  const paused = await machine();
  await driver.hibernate(paused.id);
  const live = await newDriver().listLive();
  const byId = new Map(live.map((l) => [l.id, l]));
  assert.deepEqual(byId.get(running.id), { id: running.id, state: "running", agentSocket: running.agentSocket, pid: running.pid });
  assert.equal(byId.get(paused.id)?.state, "paused");
  await driver.resume(paused.id);
});

test("create fails clearly, and quickly, when the agent cannot start; destroy then cleans up", opt, async () => {
  const broken = join(dataDir, "broken-runtime");
  await mkdir(join(broken, "bin"), { recursive: true });
  await writeFile(join(broken, "stamp"), "{}");
  const d = newDriver({ guestRuntimeDir: broken });
  const started = Date.now();
  const id = `mch_t${process.pid}broken`;
  created.add(id);
  await assert.rejects(d.create({ id, layers: [layer], hostname: "broken", vcpus: 1, memoryMb: 128, diskMb: 1024, internet: false, mounts: [] }), /tini|exec|no such file|exited/i);
  assert.ok(Date.now() - started < 10_000, "failure is reported without waiting for the full timeout");
  await d.destroy(id);
  created.delete(id);
  assert.ok(!existsSync(join(dataDir, "machines", id)));
});
