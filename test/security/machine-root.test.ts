// Machine root against the control plane and the host (issue 18, items 19–21, 24–25): the guest agent is out of
// its reach, an impostor on the agent's socket cannot hang a request or grow the server, the agent's output cannot
// grow a host file past its cap, a dead network helper is noticed and repaired (also across a restart), a shell
// line killed by the OOM killer says so, and Kiln's cgroups hold the whole host's pids and memory below its own.
// Runs on runc and gVisor.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { WebSocket } from "ws";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { TEST_RUNTIME } from "../support/paths.ts";

const GVISOR = TEST_RUNTIME === "runsc";

let k: TestKiln;
before(async () => {
  k = await startTestKiln();
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
pid = [p for p in os.listdir("/proc") if p.isdigit() and p != "1" and b"agent.mjs" in open("/proc/%s/cmdline" % p, "rb").read()][0]
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

test("an impostor on the agent's socket cannot hang a request or grow the server: giant, endless and silent answers, oversized frames", async () => {
  const m = await create();
  const impostor = await impostorFor(m.id);
  try {
    // 700 MB and more of chunked JSON: cut at the answer cap (48 MiB), a 500 at once.
    const giant = await peakRssGrowth(() => k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "giant", timeout_s: 5 } }));
    assert.equal(giant.value.status, 500, giant.value.text);
    assert.ok(giant.ms < 15_000, `the giant answer took ${giant.ms} ms`);
    assert.ok(giant.growthMb < 250, `the server grew ${giant.growthMb.toFixed(0)} MB on a giant answer`);

    // Headers, then a byte a second forever: the exec's timeout (1 s) + grace (15 s) + body bound (15 s).
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
