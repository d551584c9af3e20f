// Machine root against the control plane and the host (issue 18, items 19–21, 24–25): the guest agent is out of
// its reach, an impostor on the agent's socket cannot hang a request or grow the server, the agent's output cannot
// grow a host file past its cap, a dead network helper is noticed and repaired (also across a restart), a shell
// line killed by the OOM killer says so, and Kiln's cgroups hold the whole host's pids and memory below its own.
// Runs on runc and gVisor.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { closeSync, existsSync, openSync, readFileSync, statSync, writeSync } from "node:fs";
import { createServer } from "node:net";
import type { AddressInfo } from "node:net";
import { join } from "node:path";
import { WebSocket } from "ws";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { TEST_RUNTIME } from "../support/paths.ts";
import { HOST_LOG_MAX_BYTES } from "../../src/runtime/oci/health.ts";

const GVISOR = TEST_RUNTIME === "runsc";

let k: TestKiln;
before(async () => {
  // Host access on: a listener on the host's loopback is how a test sees a machine's network work.
  k = await startTestKiln({ env: { KILN_MACHINE_HOST_ACCESS: "1", KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

async function create(body: Record<string, unknown> = {}, on: TestKiln = k) {
  const res = await on.call("POST", "/v1/machines", { body: { template: "local/base", ...body } });
  assert.equal(res.status, 201, res.text);
  return res.body as { id: string };
}

async function sh(id: string, cmd: string, extra: Record<string, unknown> = {}, on: TestKiln = k) {
  const res = await on.call("POST", `/v1/machines/${id}/exec`, { body: { cmd, user: "root", timeout_s: 60, ...extra } });
  assert.equal(res.status, 200, res.text);
  return res.body as { exit_code: number | null; stdout: string; stderr: string; signal: string | null; oom_killed?: boolean };
}

/** The host path of a machine's agent socket (the driver's layout: runc keeps it on the host, runsc in the bound run dir). */
function agentSocketPath(on: TestKiln, id: string): string {
  return GVISOR ? join(on.dataDir, "machines", id, "run", "agent.sock") : join(on.dataDir, "machines", id, "agent.sock");
}

test("machine root cannot take the agent's sockets or memory: pidfd_getfd, ptrace and /proc of the agent and of pid 1 are refused", async () => {
  const m = await create();
  const probe = readFileSync(join(import.meta.dirname, "steal-probe.py"), "utf8");
  const out = await sh(m.id, "python3 -", { stdin: probe });
  assert.equal(out.exit_code, 0, out.stderr);
  const result = JSON.parse(out.stdout) as Record<string, Record<string, string>>;
  // The control (a process of machine root's own) is reachable by every probe: the refusals below are real.
  assert.equal(result.control.ptrace, "ok", JSON.stringify(result.control));
  assert.equal(result.control.mem, "ok");
  if (!GVISOR) assert.equal(result.control.pidfd_getfd, "ok");
  for (const target of ["agent", "init"]) {
    const r = result[target];
    assert.ok(r, `the probe found the ${target}: ${out.stdout}`);
    // pidfd_open itself may work (it only names the process); taking an fd through it must not. gVisor 20240729
    // has no pidfd syscalls at all (ENOSYS).
    assert.ok(r.pidfd_open === "ENOSYS" || r.pidfd_getfd === "EPERM", `${target}: ${JSON.stringify(r)}`);
    assert.equal(r.ptrace, "EPERM", `${target}: ${JSON.stringify(r)}`);
    assert.equal(r.mem, "EACCES", `${target}: ${JSON.stringify(r)}`);
    if (!GVISOR) {
      // runc: the agent's /proc entries belong to host root, so nothing of them opens.
      for (const what of ["environ", "fd_dir", "fd_open", "root"]) assert.equal(r[what], "EACCES", `${target} ${what}: ${JSON.stringify(r)}`);
    }
  }
  if (GVISOR) {
    // gVisor 20240729 lets the userns root list and open /proc/<pid>/fd entries of any process; sockets never open
    // that way, so the agent's listening socket and its connections stay its own.
    const fds = await sh(m.id, `python3 -c '
import os, json
pid = [p for p in os.listdir("/proc") if p.isdigit() and p != "1" and b"agent.cjs" in open("/proc/%s/cmdline" % p, "rb").read()][0]
out = {}
for fd in os.listdir("/proc/%s/fd" % pid):
    link = os.readlink("/proc/%s/fd/%s" % (pid, fd))
    if link.startswith("socket:"):
        try:
            os.close(os.open("/proc/%s/fd/%s" % (pid, fd), os.O_RDWR)); out[fd] = "opened"
        except OSError as e:
            out[fd] = e.errno
print(json.dumps(out))'`);
    const sockets = JSON.parse(fds.stdout) as Record<string, unknown>;
    assert.ok(Object.keys(sockets).length > 0, "the agent has sockets");
    for (const [fd, r] of Object.entries(sockets)) assert.notEqual(r, "opened", `the agent's socket fd ${fd} opened from inside the machine`);
  }
  assert.equal((await k.call("DELETE", `/v1/machines/${m.id}`)).status, 200);
});

/** Puts an impostor (its own process) on the machine's agent socket and makes the server connect to it afresh. */
async function impostorFor(id: string): Promise<ChildProcess> {
  const child = spawn(process.execPath, [join(import.meta.dirname, "impostor-agent.ts"), agentSocketPath(k, id)], { stdio: ["ignore", "pipe", "inherit"] });
  await new Promise<void>((resolve, reject) => {
    child.stdout!.once("data", () => resolve());
    child.once("exit", (code) => reject(new Error(`the impostor exited ${code}`)));
  });
  // A resume attaches a new agent client, whose connections go to whatever listens on the socket path now.
  assert.equal((await k.call("POST", `/v1/machines/${id}/hibernate`)).status, 200);
  assert.equal((await k.call("POST", `/v1/machines/${id}/resume`)).status, 200);
  return child;
}

/** Runs `fn` while sampling this process's RSS (the server runs in it) every 20 ms; returns the peak growth. */
async function peakRssGrowth<T>(fn: () => Promise<T>): Promise<{ value: T; growthMb: number; ms: number }> {
  global.gc?.();
  const base = process.memoryUsage().rss;
  let peak = base;
  const timer = setInterval(() => (peak = Math.max(peak, process.memoryUsage().rss)), 20);
  const t0 = Date.now();
  try {
    const value = await fn();
    return { value, growthMb: (Math.max(peak, process.memoryUsage().rss) - base) / 1024 / 1024, ms: Date.now() - t0 };
  } finally {
    clearInterval(timer);
  }
}

// The impostor listens on the host side of the agent socket and the bounds are the server's own, whatever the runtime:
// runc only (30 s of the gVisor pass).
test("an impostor on the agent's socket cannot hang a request or grow the server: giant, endless and silent answers, oversized frames", { skip: GVISOR && "the server's bounds do not depend on the runtime: runc only" }, async () => {
  const m = await create();
  const impostor = await impostorFor(m.id);
  try {
    // 700 MB and more of chunked JSON: cut at the answer cap (48 MiB), a 500 at once.
    const giant = await peakRssGrowth(() => k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "giant", timeout_s: 5 } }));
    assert.equal(giant.value.status, 500, giant.value.text);
    assert.ok(giant.ms < 15_000, `the giant answer took ${giant.ms} ms`);
    assert.ok(giant.growthMb < 250, `the server grew ${giant.growthMb.toFixed(0)} MB on a giant answer`);

    // Headers at once, then a byte a second forever: the body's bound (15 s from the headers).
    const trickle = await peakRssGrowth(() => k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "trickle", timeout_s: 1 } }));
    assert.equal(trickle.value.status, 504, trickle.value.text);
    assert.ok(trickle.ms < 45_000, `the endless answer held the request ${trickle.ms} ms`);

    // No headers ever: the exec's timeout + grace.
    const silent = await peakRssGrowth(() => k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "silent", timeout_s: 1 } }));
    assert.equal(silent.value.status, 504, silent.value.text);
    assert.ok(silent.ms < 30_000, `the silent agent held the request ${silent.ms} ms`);

    // A 16 MiB frame on the stream socket: the link is closed (frames are capped), the client's socket with it.
    const ws = new WebSocket(`${k.url.replace("http", "ws")}/v1/machines/${m.id}/ws`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
    const frame = await peakRssGrowth(
      () =>
        new Promise<number>((resolve) => {
          ws.once("close", (code) => resolve(code));
          ws.once("error", () => undefined);
        }),
    );
    assert.ok(frame.ms < 15_000, `the oversized frame held the socket ${frame.ms} ms`);

    // The server still answers, and the machine can be destroyed.
    assert.equal((await k.call("GET", "/health", { key: null })).status, 200);
  } finally {
    impostor.kill("SIGTERM");
  }
  assert.equal((await k.call("DELETE", `/v1/machines/${m.id}`)).status, 200);
});

/** Waits (bounded) until `check` holds; returns how long it took. */
async function until(what: string, check: () => boolean | Promise<boolean>, timeoutMs = 20_000): Promise<number> {
  const t0 = Date.now();
  while (!(await check())) {
    if (Date.now() - t0 > timeoutMs) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
  return Date.now() - t0;
}

/** Host pids of a machine's processes (its cgroup), runc: the machine's own processes; runsc: the sandbox's. */
function machinePids(id: string): number[] {
  const procs = `/sys/fs/cgroup/pids/kiln/${id}/cgroup.procs`;
  return existsSync(procs) ? readFileSync(procs, "utf8").split("\n").filter(Boolean).map(Number) : [];
}

test("the agent's output cannot grow a host file past the machine's disk or the log cap: runtime.log is bounded and trimmed", async () => {
  const m = await create({ disk_mb: 128 });
  const log = join(k.dataDir, "machines", m.id, "disk", "mnt", "runtime.log");
  assert.ok(existsSync(log), "runtime.log is on the machine's own disk");
  // The exec's shell is the agent's child: $PPID is the agent.
  const inside = await sh(m.id, `grep -q agent.cjs /proc/$PPID/cmdline && dd if=/dev/zero bs=1M count=300 2>&1 >>/proc/$PPID/fd/1 | tail -1`);
  if (GVISOR) {
    // gVisor 20240729 lets machine root open the agent's stdout: the write stops at the machine's own disk.
    assert.match(inside.stdout, /No space left on device|copied/, inside.stdout);
  } else {
    assert.match(inside.stdout, /Permission denied/, `runc: the agent's stdout is not machine root's to open: ${inside.stdout}`);
    // Simulate a writer that got hold of it anyway: 300 MiB from the host into the agent's own fd 1.
    const agent = machinePids(m.id).find((pid) => readFileSync(`/proc/${pid}/cmdline`, "utf8").includes("agent.cjs") && !readFileSync(`/proc/${pid}/cmdline`, "utf8").includes("tini"));
    assert.ok(agent, "the agent's host pid");
    const fd = openSync(`/proc/${agent}/fd/1`, "a");
    const mib = Buffer.alloc(1024 * 1024, 0x41);
    let written = 0;
    let stopped = "";
    try {
      for (let i = 0; i < 300; i++) written += writeSync(fd, mib);
    } catch (err) {
      stopped = (err as NodeJS.ErrnoException).code ?? String(err);
    } finally {
      closeSync(fd);
    }
    assert.equal(stopped, "ENOSPC", `the writes stop at the machine's disk (wrote ${written} bytes)`);
  }
  assert.ok(statSync(log).size <= 128 * 1024 * 1024, `runtime.log is ${statSync(log).size} bytes, past the machine's 128 MiB disk`);
  // The health pass trims it to its cap within seconds, and the machine's disk is free again.
  const trimmed = () => statSync(log).size <= HOST_LOG_MAX_BYTES && /earlier bytes of this log were dropped/.test(readFileSync(log, "utf8").slice(0, 200));
  const ms = await until("runtime.log trimmed", trimmed);
  assert.ok(ms < 10_000, `trimmed after ${ms} ms`);
  assert.equal((await sh(m.id, "head -c 10485760 /dev/zero > /tmp/ten && echo written")).stdout, "written\n");
  assert.equal((await k.call("DELETE", `/v1/machines/${m.id}`)).status, 200);
});

/** A loopback TCP listener on the host: what host.kiln.internal reaches from a machine. */
async function hostListener() {
  const server = createServer((s) => s.end("hello from the host\n"));
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  return { port: (server.address() as AddressInfo).port, close: () => new Promise<void>((resolve) => server.close(() => resolve())) };
}

async function reachesHost(id: string, port: number, on: TestKiln = k): Promise<boolean> {
  const r = await sh(id, `timeout 5 bash -c 'exec 3<>/dev/tcp/host.kiln.internal/${port} && cat <&3'`, {}, on);
  return r.stdout === "hello from the host\n";
}

function slirpPid(on: TestKiln, id: string): number {
  return Number(readFileSync(join(on.dataDir, "machines", id, "slirp.pid"), "utf8"));
}

/** The restarted helper is in the machine's own egress cgroup (the host's nftables rules match on it). */
function assertEgressTagged(on: TestKiln, id: string) {
  const cgroup = readFileSync(`/proc/${slirpPid(on, id)}/cgroup`, "utf8");
  assert.match(cgroup, new RegExp(`^0::/kiln-egress/host-access/${id}$`, "m"), cgroup);
}

test("kill -9 of a machine's slirp4netns is repaired within seconds: same namespace, same egress cgroup, the network works", async () => {
  const listener = await hostListener();
  try {
    const m = await create();
    assert.ok(await reachesHost(m.id, listener.port));
    const old = slirpPid(k, m.id);
    process.kill(old, "SIGKILL");
    const ms = await until("a new slirp4netns", () => existsSync(join(k.dataDir, "machines", m.id, "slirp.pid")) && slirpPid(k, m.id) !== old && existsSync(`/proc/${slirpPid(k, m.id)}`));
    assert.ok(ms < 10_000, `repaired after ${ms} ms`);
    assertEgressTagged(k, m.id);
    assert.ok(await reachesHost(m.id, listener.port), "the machine reaches the host again");
    assert.equal((await k.call("GET", `/v1/machines/${m.id}`)).body.status, "running");
    assert.equal((await k.call("DELETE", `/v1/machines/${m.id}`)).status, 200);
  } finally {
    await listener.close();
  }
});

test("a slirp4netns killed while no server runs is repaired at the next start", async () => {
  const listener = await hostListener();
  const first = await startTestKiln({ env: { KILN_MACHINE_HOST_ACCESS: "1", KILN_WARM_POOL: "0" } });
  let second: TestKiln | undefined;
  try {
    const m = await create({}, first);
    await first.stop();
    const old = slirpPid(first, m.id);
    process.kill(old, "SIGKILL");
    await until("slirp4netns gone", () => !existsSync(`/proc/${old}`) || readFileSync(`/proc/${old}/stat`, "utf8").includes(") Z"));
    second = await startTestKiln({ dataDir: first.dataDir, env: { KILN_MACHINE_HOST_ACCESS: "1", KILN_WARM_POOL: "0" } });
    // Repaired during the start, before anything is served.
    assert.notEqual(slirpPid(second, m.id), old);
    assertEgressTagged(second, m.id);
    assert.equal((await second.call("GET", `/v1/machines/${m.id}`)).body.status, "running");
    assert.ok(await reachesHost(m.id, listener.port, second), "the machine reaches the host after the restart");
  } finally {
    await (second ?? first).close();
    await listener.close();
  }
});

test("a shell line killed by the OOM killer answers signal SIGKILL and oom_killed, as the args form does (REST and stream)", { skip: GVISOR && "gVisor enforces the memory limit on the whole sandbox: the host kills the sentry, not a process inside" }, async () => {
  const m = await create({ memory_mb: 256, internet: false });
  const res = await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "tail /dev/zero", timeout_s: 120 } });
  assert.equal(res.status, 200, res.text);
  assert.deepEqual({ exit_code: res.body.exit_code, signal: res.body.signal, oom_killed: res.body.oom_killed }, { exit_code: null, signal: "SIGKILL", oom_killed: true });
  // A shell line that exits 137 on its own, with no OOM kill meanwhile, keeps its exit code.
  const plain = await sh(m.id, "exit 137", { user: "user" });
  assert.deepEqual({ exit_code: plain.exit_code, signal: plain.signal, oom_killed: plain.oom_killed }, { exit_code: 137, signal: null, oom_killed: undefined });
  // The same over the stream socket's exec.exit frame.
  const ws = new WebSocket(`${k.url.replace("http", "ws")}/v1/machines/${m.id}/ws`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  const exit = await new Promise<Record<string, unknown>>((resolve, reject) => {
    ws.once("error", reject);
    ws.once("open", () => ws.send(JSON.stringify({ type: "exec.start", request_id: "oom", cmd: "tail /dev/zero" })));
    ws.on("message", (data) => {
      const f = JSON.parse(String(data));
      if (f.type === "exec.exit") resolve(f);
    });
  });
  ws.close();
  assert.deepEqual({ exit_code: exit.exit_code, signal: exit.signal, oom_killed: exit.oom_killed }, { exit_code: null, signal: "SIGKILL", oom_killed: true });
  assert.equal((await k.call("DELETE", `/v1/machines/${m.id}`)).status, 200);
});

test("Kiln's parent cgroup caps all machines together below the host's pid_max and memory", async () => {
  const m = await create();
  const read = (file: string) => Number(readFileSync(file, "utf8").trim());
  const pidMax = Math.min(read("/proc/sys/kernel/pid_max"), read("/proc/sys/kernel/threads-max"));
  const memTotal = Number(/^MemTotal:\s+(\d+) kB/m.exec(readFileSync("/proc/meminfo", "utf8"))![1]) * 1024;
  const v2 = existsSync("/sys/fs/cgroup/cgroup.controllers");
  const pids = v2 ? "/sys/fs/cgroup/kiln" : "/sys/fs/cgroup/pids/kiln";
  const memory = v2 ? "/sys/fs/cgroup/kiln/memory.max" : "/sys/fs/cgroup/memory/kiln/memory.limit_in_bytes";
  // The documented defaults: ¾ of the host's task limit, RAM less 10 % (at least 1 GiB kept).
  assert.equal(read(`${pids}/pids.max`), Math.floor(pidMax * 0.75));
  assert.ok(read(`${pids}/pids.max`) < pidMax);
  assert.equal(read(memory), Math.floor((memTotal - Math.max(1024 ** 3, memTotal * 0.1)) / 1024 ** 2) * 1024 ** 2);
  assert.ok(read(memory) < memTotal);
  // The machine's processes count against it: its own cgroup is below it in the hierarchy (other servers' machines
  // share the parent, so its own count is the one to look at).
  // (gVisor: the host sees the sandbox's own threads there, not the machine's processes.)
  await sh(m.id, "for i in $(seq 50); do sleep 60 >/dev/null 2>&1 & done; echo started");
  assert.ok(read(`${pids}/${m.id}/pids.current`) >= (GVISOR ? 1 : 50), `the machine's pids.current is ${read(`${pids}/${m.id}/pids.current`)}`);
  assert.ok(read(`${pids}/pids.current`) >= read(`${pids}/${m.id}/pids.current`));
  assert.equal((await k.call("DELETE", `/v1/machines/${m.id}`)).status, 200);
});
