// Machines through the API: create from local/base, isolation, lifecycle events, hibernate/resume keeps state,
// timeouts, destroy cleans up, and a restarted server adopts live machines.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import { execFileSync } from "node:child_process";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { TEST_RUNTIME } from "../support/paths.ts";
import { containerName } from "../../src/runtime/oci/driver.ts";
import { GUEST_LOADER } from "../../src/runtime/guest-runtime.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln();
});
after(async () => k?.close());

async function create(body: Record<string, unknown> = {}) {
  const res = await k.call("POST", "/v1/machines", { body: { template: "local/base", ...body } });
  assert.equal(res.status, 201, res.text);
  return res.body;
}

async function sh(id: string, cmd: string, extra: Record<string, unknown> = {}) {
  const res = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd, ...extra } });
  assert.equal(res.status, 200, res.text);
  return res.body as { exit_code: number; stdout: string; stderr: string };
}

async function events(machineId: string) {
  const rows = await k.kiln.services.store.db.selectFrom("events").selectAll().where("machine_id", "=", machineId).orderBy("seq").execute();
  return rows.map((r) => r.operation);
}

test("create answers a running machine from local/base, and exec runs in it", async () => {
  const m = await create({ name: "first", metadata: { team: "a" } });
  assert.match(m.id, /^mch_/);
  assert.equal(m.status, "running");
  assert.equal(m.user, "user");
  assert.deepEqual(m.metadata, { team: "a" });
  assert.ok(Date.parse(m.expires_at) > Date.now());
  const r = await sh(m.id, "echo hello; id -un; pwd");
  assert.equal(r.exit_code, 0);
  assert.equal(r.stdout, "hello\nuser\n/workspace\n");
  assert.deepEqual(await events(m.id), ["create"]);
  // What agents (and E2B's `base` users) expect to find in the base template.
  const tools = await sh(m.id, "for t in python python3 pip bash git curl; do command -v $t >/dev/null && echo $t; done; python -c 'print(6*7)'");
  assert.equal(tools.stdout, "python\npython3\npip\nbash\ngit\ncurl\n42\n");
});

test("the warm pool hands out booted machines that still honour envs, cwd and user, and refills", async () => {
  const pool = k.kiln.services.pool;
  for (let i = 0; i < 200 && pool.stats().ready === 0; i++) await new Promise((r) => setTimeout(r, 50));
  const pooled = pool.stats().ids;
  assert.ok(pooled.length > 0, "the pool filled");
  const m = await create({ envs: { FROM_POOL: "yes" }, cwd: "/srv/pooled", user: "root" });
  assert.ok(pooled.includes(m.id), "the machine came from the pool");
  const r = await sh(m.id, "echo $FROM_POOL; pwd; id -un");
  assert.equal(r.stdout, "yes\n/srv/pooled\nroot\n");
  // Any vcpus/memory may come from the pool (runc sizes it at handout); a network policy is set at boot.
  const odd = await create({ internet: false });
  assert.ok(!pooled.includes(odd.id), "a machine the pool cannot serve is booted for the request");
  for (let i = 0; i < 200 && pool.stats().ready < pool.stats().size; i++) await new Promise((r) => setTimeout(r, 50));
  assert.equal(pool.stats().ready, pool.stats().size, "the pool refills");
});

test("the agent is compiled from the bundle's compile cache, which the machine can read but not change", async () => {
  const m = await create();
  const { agent } = await k.kiln.services.machines.agentOf(m.id);
  const dir = (await agent.health()).compile_cache;
  assert.match(String(dir), /^\/opt\/kiln\/agent\/compile-cache\/v[0-9.]+-/);
  const root = { user: "root" };
  assert.notEqual((await sh(m.id, `touch ${dir}/x`, root)).exit_code, 0);
  assert.match((await sh(m.id, `ls ${dir}`, root)).stdout, /^[0-9a-f]+\n$/);
  // The machine's own node, started as the agent is, with Node's compile-cache log: V8 takes the cached code here.
  const probe = await sh(
    m.id,
    `mkdir -p /tmp/probe && NODE_DEBUG_NATIVE=COMPILE_CACHE TMPDIR=/tmp/probe /opt/kiln/lib/${GUEST_LOADER} --library-path /opt/kiln/lib /opt/kiln/bin/node /opt/kiln/agent/agent.cjs --socket /tmp/probe/agent.sock 2>/tmp/probe.log & ` +
      `for i in $(seq 1000); do [ -S /tmp/probe/agent.sock ] && break; sleep 0.01; done; kill $!; wait; cat /tmp/probe.log`,
    root,
  );
  assert.match(probe.stdout, /V8 code cache for CommonJS \/opt\/kiln\/agent\/main\.cjs was accepted/, probe.stdout + probe.stderr);
  await k.call("DELETE", `/v1/machines/${m.id}`);
});

test("exec: argv form, exit codes, stdin, envs, user root, cwd", async () => {
  const m = await create({ envs: { GREETING: "hi" } });
  assert.equal((await sh(m.id, "exit 7")).exit_code, 7);
  assert.equal((await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "printf", args: ["%s|", "a b", "$HOME"] } })).body.stdout, "a b|$HOME|");
  assert.equal((await sh(m.id, "cat", { stdin: "from stdin" })).stdout, "from stdin");
  assert.equal((await sh(m.id, "echo $GREETING $OTHER", { envs: { OTHER: "there" } })).stdout, "hi there\n");
  assert.equal((await sh(m.id, "id -u", { user: "root" })).stdout, "0\n");
  assert.equal((await sh(m.id, "pwd", { cwd: "/tmp" })).stdout, "/tmp\n");
  const unknown = await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "true", user: "nobody-here" } });
  assert.equal(unknown.status, 400);
  assert.equal(unknown.body.code, "invalid_request");
});

test("isolation: own pid 1 and hostname, no host processes or files, root is an unprivileged host uid", async () => {
  const m = await create();
  const r = await sh(m.id, "cat /proc/1/cmdline | tr '\\0' ' '; echo; hostname; ps -e --no-headers | wc -l; test -e /work && echo host-visible || echo host-hidden", { user: "root" });
  const [cmdline, hostname, procs, visible] = r.stdout.trim().split("\n");
  assert.match(cmdline, /tini/);
  assert.equal(hostname, m.id.replaceAll("_", "-"));
  assert.ok(Number(procs) < 10, `only the machine's processes are visible (saw ${procs})`);
  assert.equal(visible, "host-hidden");
  // Seen from the host (gVisor's own /proc cannot tell): the machine's first process runs as an unprivileged uid.
  const live = (await k.kiln.services.driver.listLive()).find((l) => l.id === m.id)!;
  const hostUid = Number(/^Uid:\s+(\d+)/m.exec(readFileSync(`/proc/${live.pid}/status`, "utf8"))![1]);
  assert.ok(hostUid >= 100000, `machine root maps to host uid ${hostUid}`);
  const capEff = (await sh(m.id, "grep CapEff /proc/self/status", { user: "root" })).stdout;
  assert.notEqual(capEff.trim().split(/\s+/)[1], "000001ffffffffff", "machine root does not hold every capability");
});

test("two machines from one template do not see each other's writes, and the template is untouched", async () => {
  const a = await create();
  const b = await create();
  await sh(a.id, "echo from-a > /etc/kiln-marker; echo a > /workspace/a.txt", { user: "root" });
  assert.equal((await sh(a.id, "cat /etc/kiln-marker")).stdout, "from-a\n");
  assert.notEqual((await sh(b.id, "cat /etc/kiln-marker")).exit_code, 0);
  assert.notEqual((await sh(b.id, "cat /workspace/a.txt")).exit_code, 0);
  const resolved = await k.kiln.services.templates.resolve("local/base");
  for (const layer of resolved.layers) assert.equal(existsSync(`${layer}/etc/kiln-marker`), false, "the lower layer was not written");
});

test("hibernate freezes, resume continues with state kept; events are recorded", async () => {
  const m = await create();
  await sh(m.id, "echo kept > /workspace/state.txt; (while true; do date +%s%N >> /tmp/ticks; sleep 0.05; done) >/dev/null 2>&1 &");
  const h = await k.call("POST", `/v1/machines/${m.id}/hibernate`);
  assert.equal(h.status, 200, h.text);
  assert.equal(h.body.status, "hibernated");
  const blocked = await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "true" } });
  assert.equal(blocked.status, 409);
  assert.equal(blocked.body.code, "machine_not_running");
  const r = await k.call("POST", `/v1/machines/${m.id}/resume`);
  assert.equal(r.body.status, "running");
  assert.equal((await sh(m.id, "cat /workspace/state.txt")).stdout, "kept\n");
  const before = Number((await sh(m.id, "wc -l < /tmp/ticks")).stdout);
  await new Promise((res) => setTimeout(res, 300));
  assert.ok(Number((await sh(m.id, "wc -l < /tmp/ticks")).stdout) > before, "the background loop runs again after resume");
  assert.deepEqual(await events(m.id), ["create", "hibernate", "resume"]);
});

test("PATCH extends the timeout; an expired machine is destroyed", async () => {
  const m = await create({ timeout_s: 2 });
  const p = await k.call("PATCH", `/v1/machines/${m.id}`, { body: { timeout_s: 3 } });
  assert.equal(p.status, 200);
  assert.ok(Date.parse(p.body.expires_at) > Date.parse(m.expires_at));
  // Destroyed by the sweeper soon after the 3 s: poll rather than guess how long a destroy takes on this runtime.
  let g = await k.call("GET", `/v1/machines/${m.id}`);
  for (const started = Date.now(); g.body.status !== "destroyed" && Date.now() - started < 15_000; ) {
    await new Promise((res) => setTimeout(res, 250));
    g = await k.call("GET", `/v1/machines/${m.id}`);
  }
  assert.ok(Date.now() - Date.parse(p.body.expires_at) > -250, "not destroyed before it expired");
  assert.equal(g.body.status, "destroyed");
  assert.equal(g.body.failure_reason, "timeout");
  assert.deepEqual(await events(m.id), ["create", "update", "destroy"]);
});

test("destroy leaves no process, mount or directory behind", async () => {
  const m = await create();
  const dir = `${k.dataDir}/machines/${m.id}`;
  assert.ok(existsSync(dir));
  const d = await k.call("DELETE", `/v1/machines/${m.id}`);
  assert.equal(d.status, 200);
  assert.equal(d.body.status, "destroyed");
  assert.equal(existsSync(dir), false);
  assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(m.id), "no mount left");
  const procs = execFileSync("ps", ["-eo", "args"], { encoding: "utf8" });
  assert.ok(!procs.includes(m.id), "no process left");
  assert.equal((await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "true" } })).status, 409);
  assert.equal((await k.call("DELETE", `/v1/machines/${m.id}`)).status, 200, "destroy is idempotent");
});

test("bad input changes nothing: unknown template, bad values, unknown machine", async () => {
  const before = (await k.call("GET", "/v1/machines?limit=100")).body.machines.length;
  assert.equal((await k.call("POST", "/v1/machines", { body: { template: "local/nope" } })).status, 404);
  assert.equal((await k.call("POST", "/v1/machines", { body: { timeout_s: 0 } })).status, 400);
  assert.equal((await k.call("POST", "/v1/machines", { body: { memory_mb: 1 } })).status, 400);
  assert.equal((await k.call("POST", "/v1/machines", { body: { user: "ghost" } })).status, 400);
  assert.equal((await k.call("GET", "/v1/machines?limit=100")).body.machines.length, before);
  assert.equal((await k.call("GET", "/v1/machines/mch_00000000000000000000000000")).status, 404);
  assert.equal((await k.call("POST", "/v1/machines/mch_00000000000000000000000000/hibernate")).status, 404);
});

test("list is paginated newest first with a stable cursor", async () => {
  const made = [await create(), await create(), await create()];
  const page1 = await k.call("GET", "/v1/machines?limit=2");
  assert.equal(page1.body.machines.length, 2);
  assert.ok(page1.body.next_cursor);
  await create(); // an insert between pages does not shift the next page
  const page2 = await k.call("GET", `/v1/machines?limit=2&cursor=${encodeURIComponent(page1.body.next_cursor)}`);
  const ids = [...page1.body.machines, ...page2.body.machines].map((m: any) => m.id);
  assert.deepEqual(ids.slice(0, 3), made.map((m) => m.id).reverse());
  assert.equal((await k.call("GET", "/v1/machines?cursor=garbage")).status, 400);
});

test("a port a process listens on inside the machine is reachable from the host through the agent", async () => {
  const m = await create({ internet: false });
  await sh(m.id, "echo served-from-the-machine > /workspace/index.html; (cd /workspace && nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &)");
  const { agent } = await k.kiln.services.machines.agentOf(m.id);
  let body = "";
  for (let i = 0; i < 50 && !body.includes("served-from-the-machine"); i++) {
    const socket = await agent.connectPort(8000).catch(() => undefined);
    if (!socket) {
      await new Promise((r) => setTimeout(r, 100));
      continue;
    }
    socket.end("GET /index.html HTTP/1.0\r\n\r\n");
    body = "";
    for await (const chunk of socket) body += chunk;
  }
  assert.match(body, /^HTTP\/1\.0 200/);
  assert.match(body, /served-from-the-machine/);
  await assert.rejects(agent.connectPort(8001), /nothing is listening on port 8001/);
});

test("internet: false leaves only loopback", async () => {
  const m = await create({ internet: false });
  const r = await sh(m.id, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '");
  assert.equal(r.stdout.trim(), "lo");
});

test("a machine killed from outside Kiln is found and destroyed with a reason, leaving nothing behind", async () => {
  const m = await create({ internet: true });
  const dir = `${k.dataDir}/machines/${m.id}`;
  const slirpPid = Number(readFileSync(`${dir}/slirp.pid`, "utf8"));
  const pid = (await k.kiln.services.driver.listLive()).find((l) => l.id === m.id)!.pid;
  process.kill(pid, "SIGKILL");
  // The server looks every few seconds; ask now, as that look would (gVisor's first process may stay a zombie a while).
  for (let i = 0; i < 50 && (await k.call("GET", `/v1/machines/${m.id}`)).body.status !== "destroyed"; i++) {
    await k.kiln.services.machines.reapDead();
    await new Promise((res) => setTimeout(res, 200));
  }
  const g = await k.call("GET", `/v1/machines/${m.id}`);
  assert.equal(g.body.status, "destroyed");
  assert.equal(g.body.failure_reason, "the machine stopped unexpectedly");
  assert.deepEqual(await events(m.id), ["create", "destroy"]);
  // Its remains go behind the destroy (teardown.ts).
  assert.equal(await k.kiln.services.machines.cleanupsSettled(60_000), true);
  assert.equal(existsSync(dir), false);
  assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(m.id), "no mount left");
  assert.ok(!existsSync(`/proc/${slirpPid}/cmdline`) || !readFileSync(`/proc/${slirpPid}/cmdline`, "utf8").startsWith("slirp4netns"), "slirp4netns is gone");
  // A live machine is left alone.
  const alive = await create();
  assert.equal(await k.kiln.services.machines.reapDead(), 0);
  assert.equal((await k.call("GET", `/v1/machines/${alive.id}`)).body.status, "running");
});

test("a restarted server adopts live machines and marks gone ones destroyed", async () => {
  const dataDir = k.dataDir;
  const keep = await create();
  const gone = await create();
  await sh(keep.id, "echo survived > /workspace/s.txt");
  await k.stop();
  // The machine "gone" dies while the server is down.
  execFileSync(TEST_RUNTIME, ["--root", `${dataDir}/oci-state/${TEST_RUNTIME}`, "kill", containerName(TEST_RUNTIME, gone.id), "KILL"]);
  await new Promise((res) => setTimeout(res, 200));
  k = await startTestKiln({ dataDir });
  assert.equal((await k.call("GET", `/v1/machines/${keep.id}`)).body.status, "running");
  assert.equal((await sh(keep.id, "cat /workspace/s.txt")).stdout, "survived\n");
  assert.equal((await k.call("GET", `/v1/machines/${gone.id}`)).body.status, "destroyed");
  assert.equal(existsSync(`${dataDir}/machines/${gone.id}`), false);
});
