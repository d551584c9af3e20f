// A greedy or curious machine cannot hurt the host: its disk is its own size (ENOSPC past disk_mb), its egress never
// reaches the host, link-local or private ranges unless allow_out opens them, creates the host cannot hold are
// refused, and a machine that dies of memory says so. After each, nothing is left on the host.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, readFileSync, readdirSync, writeFileSync } from "node:fs";
import { execFileSync, spawn } from "node:child_process";
import { chmod, mkdtemp, rm, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { cpus, tmpdir, totalmem } from "node:os";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { hostAddress, listenCounting } from "../support/net.ts";

let k: TestKiln;
before(async () => {
  // Host access on: host.kiln.internal is the one documented way to the host, everything else of the host is refused.
  k = await startTestKiln({ env: { KILN_MACHINE_HOST_ACCESS: "1", KILN_WARM_POOL: "1" } });
});
after(async () => k?.close());

async function create(body: Record<string, unknown> = {}, server = k) {
  const res = await server.call("POST", "/v1/machines", { body: { template: "local/base", ...body } });
  assert.equal(res.status, 201, res.text);
  return res.body;
}

async function sh(id: string, cmd: string, extra: Record<string, unknown> = {}) {
  const res = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd, ...extra } });
  assert.equal(res.status, 200, res.text);
  return res.body as { exit_code: number; stdout: string; stderr: string };
}

/** A TCP connect from inside the machine (bash's /dev/tcp): "ok", "refused" or "timeout". */
async function connectFrom(id: string, host: string, port: number): Promise<string> {
  const r = await sh(id, `timeout 5 bash -c 'exec 3<>/dev/tcp/${host}/${port} && echo ok'`, { user: "root" });
  if (r.exit_code === 0 && r.stdout.includes("ok")) return "ok";
  if (r.exit_code === 124) return "timeout";
  return /refused/i.test(r.stderr) ? "refused" : `other: ${r.exit_code} ${r.stderr.trim()}`;
}

function nft(...args: string[]): string {
  try {
    return execFileSync("nft", args, { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] });
  } catch {
    return "";
  }
}

/** What a machine could leave on the host: mounts, loop devices, cgroups, nftables elements, slirp4netns. */
function assertNothingLeft(id: string, slirpPid?: number) {
  assertNothingLeftIn(k, id, slirpPid);
}

function assertNothingLeftIn(server: TestKiln, id: string, slirpPid?: number) {
  assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(id), "no mount left");
  assert.ok(!execFileSync("losetup", ["-a"], { encoding: "utf8" }).includes(id), "no loop device left");
  for (const root of ["/sys/fs/cgroup/unified/kiln-egress", "/sys/fs/cgroup/kiln-egress"]) {
    if (!existsSync(root)) continue;
    for (const group of readdirSync(root, { withFileTypes: true }).filter((d) => d.isDirectory())) {
      assert.ok(!existsSync(`${root}/${group.name}/${id}`), `no egress cgroup left under ${group.name}`);
    }
  }
  for (const c of readdirSync("/sys/fs/cgroup")) assert.ok(!existsSync(`/sys/fs/cgroup/${c}/kiln/${id}`), `no ${c} cgroup left`);
  assert.ok(!nft("list", "table", "inet", "kiln").includes(id), "no nftables chain, set or element left");
  if (slirpPid) {
    const cmd = existsSync(`/proc/${slirpPid}/cmdline`) ? readFileSync(`/proc/${slirpPid}/cmdline`, "utf8") : "";
    assert.ok(!cmd.startsWith("slirp4netns"), "slirp4netns is gone");
  }
  assert.ok(!existsSync(`${server.dataDir}/machines/${id}`), "machine dir removed");
}

async function destroy(id: string) {
  const pidFile = `${k.dataDir}/machines/${id}/slirp.pid`;
  const slirp = existsSync(pidFile) ? Number(readFileSync(pidFile, "utf8")) : undefined;
  const d = await k.call("DELETE", `/v1/machines/${id}`);
  assert.equal(d.status, 200, d.text);
  assertNothingLeft(id, slirp);
}

test("disk_mb bounds the writable layer: df / shows its size, and writing past it fails with ENOSPC", async () => {
  const m = await create({ disk_mb: 256 });
  assert.equal(m.disk_mb, 256);
  const df = await sh(m.id, "df -P -m / | tail -n 1");
  const sizeMb = Number(df.stdout.trim().split(/\s+/)[1]);
  assert.ok(sizeMb > 200 && sizeMb <= 256, `df / shows ${sizeMb} MiB: ${df.stdout}`);
  const dd = await sh(m.id, "dd if=/dev/zero of=/workspace/fill bs=1M count=400 2>&1; echo exit=$?");
  assert.match(dd.stdout, /No space left on device/);
  assert.doesNotMatch(dd.stdout, /exit=0/);
  // The machine lives on: a file is freed and writing works again.
  assert.equal((await sh(m.id, "rm /workspace/fill && echo fine > /workspace/after && cat /workspace/after")).stdout, "fine\n");
  const view = await k.call("GET", `/v1/machines/${m.id}`);
  assert.equal(view.body.disk_mb, 256);
  await destroy(m.id);
});

test("the default disk is 10 GiB and the warm pool's machines have it", async () => {
  const pool = k.kiln.services.pool;
  for (let i = 0; i < 200 && pool.stats().ready === 0; i++) await new Promise((r) => setTimeout(r, 50));
  const pooled = pool.stats().ids;
  const m = await create();
  assert.ok(pooled.includes(m.id), "the machine came from the warm pool");
  assert.equal(m.disk_mb, 10240);
  const sizeMb = Number((await sh(m.id, "df -P -m / | tail -n 1")).stdout.trim().split(/\s+/)[1]);
  assert.ok(sizeMb > 9800 && sizeMb <= 10240, `df / shows ${sizeMb} MiB`);
  await destroy(m.id);
});

test("bad disk_mb and network values are refused and change nothing", async () => {
  const before = (await k.call("GET", "/v1/machines?limit=100")).body.machines.length;
  for (const body of [{ disk_mb: 10 }, { disk_mb: 200_000 }, { network: { allow_out: ["10.0.0.0/33"] } }, { network: { deny_out: ["not-a-cidr"] } }, { network: { allow_out: ["1.2.3.4/8/9"] } }, { network: { other: [] } }]) {
    const res = await k.call("POST", "/v1/machines", { body: { template: "local/base", ...body } });
    assert.equal(res.status, 400, `${JSON.stringify(body)} → ${res.text}`);
    assert.equal(res.body.code, "invalid_request");
  }
  assert.equal((await k.call("GET", "/v1/machines?limit=100")).body.machines.length, before);
});

test("egress: the host's own address, link-local and private ranges are refused; allow_out opens the host again", async () => {
  const addr = hostAddress();
  const l = await listenCounting(addr);
  const loopback = await listenCounting("127.0.0.1");
  try {
    const m = await create({ vcpus: 1, memory_mb: 512 });
    assert.equal(await connectFrom(m.id, addr, l.port), "refused", "a listener on the host's own non-loopback address is refused");
    assert.equal(await connectFrom(m.id, "169.254.169.254", 80), "refused", "cloud metadata is refused");
    assert.equal(await connectFrom(m.id, "10.1.2.3", 80), "refused", "private ranges are refused");
    assert.equal(await connectFrom(m.id, "192.168.7.7", 80), "refused");
    assert.equal(l.accepted(), 0, "nothing reached the host listener");
    // The documented exception: host.kiln.internal is the host's loopback.
    assert.equal(await connectFrom(m.id, "host.kiln.internal", loopback.port), "ok");
    // DNS still works through the host's resolvers (which may sit in a private range), and so does the internet.
    const dns = await sh(m.id, "getent hosts deb.debian.org");
    assert.equal(dns.exit_code, 0, dns.stderr);
    const mirror = dns.stdout.trim().split(/\s+/)[0];
    assert.equal(await connectFrom(m.id, mirror, 80), "ok", "the internet (the Debian mirror) is reachable");
    assert.deepEqual(m.network, { allow_out: [], deny_out: [] });

    const opened = await create({ network: { allow_out: [`${addr}/32`], deny_out: [`${mirror}`] } });
    assert.deepEqual(opened.network, { allow_out: [`${addr}/32`], deny_out: [`${mirror}/32`] });
    assert.equal((await k.call("GET", `/v1/machines/${opened.id}`)).body.network.deny_out[0], `${mirror}/32`);
    assert.equal(await connectFrom(opened.id, addr, l.port), "ok", "allow_out opens the host's address");
    assert.equal(l.accepted(), 1);
    assert.equal(await connectFrom(opened.id, mirror, 80), "refused", "deny_out closes a public address");
    assert.equal(await connectFrom(opened.id, "169.254.169.254", 80), "refused", "what allow_out does not name stays closed");
    await destroy(m.id);
    await destroy(opened.id);
  } finally {
    l.server.close();
    loopback.server.close();
  }
});

test("an allow list: deny_out 0.0.0.0/0 with allow_out of one address", async () => {
  const addr = hostAddress();
  const l = await listenCounting(addr);
  try {
    const m = await create({ network: { deny_out: ["0.0.0.0/0"], allow_out: [addr] } });
    assert.equal(await connectFrom(m.id, addr, l.port), "ok");
    const mirror = (await sh(m.id, "getent hosts deb.debian.org")).stdout.trim().split(/\s+/)[0];
    assert.ok(mirror, "DNS still answers");
    assert.equal(await connectFrom(m.id, mirror, 80), "refused");
    await destroy(m.id);
  } finally {
    l.server.close();
  }
});

test("a machine without internet is unaffected: loopback only, no egress cgroup", async () => {
  const m = await create({ internet: false, network: { allow_out: ["10.0.0.0/8"] } });
  assert.equal((await sh(m.id, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")).stdout.trim(), "lo");
  assert.ok(!existsSync(`${k.dataDir}/machines/${m.id}/egress.json`));
  assert.equal((await sh(m.id, "echo ok")).stdout, "ok\n");
  await destroy(m.id);
});

test("admission: a machine larger than the host is refused with 400", async () => {
  const cores = cpus().length;
  const tooMany = await k.call("POST", "/v1/machines", { body: { vcpus: cores + 1 } });
  assert.equal(tooMany.status, 400, tooMany.text);
  assert.match(tooMany.body.error, /cores/);
  const hostMb = Math.floor(totalmem() / 1024 / 1024);
  const tooBig = await k.call("POST", "/v1/machines", { body: { memory_mb: Math.min(262_144, hostMb + 1024) } });
  assert.equal(tooBig.status, 400, tooBig.text);
  assert.match(tooBig.body.error, /memory/);
});

test("admission: under the free-memory floor creates answer 503 unavailable, retryable; /v1/ready shows capacity", async () => {
  const tight = await startTestKiln({ env: { KILN_MIN_FREE_MEMORY_MB: String(1 << 29), KILN_WARM_POOL: "0" } });
  try {
    const res = await tight.call("POST", "/v1/machines", { body: { template: "local/base" } });
    assert.equal(res.status, 503, res.text);
    assert.equal(res.body.code, "unavailable");
    assert.equal(res.body.error_detail.retryable, true);
    assert.match(res.body.error, /memory/);
    assert.equal((await tight.call("GET", "/v1/machines?status=failed")).body.machines.length, 0, "no record was made");
    const ready = await tight.call("GET", "/v1/ready");
    assert.equal(ready.body.capacity.accepting, false);
    assert.equal(ready.body.capacity.min_free_memory_mb, 1 << 29);
    assert.ok(ready.body.capacity.mem_available_mb > 0);
  } finally {
    await tight.close();
  }
  const ready = await k.call("GET", "/v1/ready");
  assert.equal(ready.status, 200, ready.text);
  const c = ready.body.capacity;
  assert.equal(c.accepting, true);
  assert.equal(c.min_free_memory_mb, Math.floor(Math.floor(totalmem() / 1024 / 1024) / 10), "the default floor is 10 % of RAM");
  assert.ok(c.free_disk_mb > 0 && c.min_free_disk_mb === 2048);
  assert.equal(typeof c.live_machines, "number");
  assert.match(ready.body.driver.network, /nftables/);
});

test("admission: KILN_MEMORY_OVERCOMMIT caps the declared memory of live machines", async () => {
  const hostMb = Math.floor(totalmem() / 1024 / 1024);
  const capped = await startTestKiln({ env: { KILN_MEMORY_OVERCOMMIT: String(1536 / hostMb), KILN_WARM_POOL: "0" } });
  try {
    const first = await capped.call("POST", "/v1/machines", { body: { template: "local/base", memory_mb: 1024, internet: false } });
    assert.equal(first.status, 201, first.text);
    const second = await capped.call("POST", "/v1/machines", { body: { template: "local/base", memory_mb: 1024, internet: false } });
    assert.equal(second.status, 503, second.text);
    assert.equal(second.body.error_detail.retryable, true);
    assert.equal((await capped.call("GET", "/v1/ready")).body.capacity.declared_memory_mb, 1024);
  } finally {
    await capped.close();
  }
});

test("memory limits include swap where the host accounts it (memsw)", async () => {
  const m = await create({ memory_mb: 256, internet: false });
  const dir = `/sys/fs/cgroup/memory/kiln/${m.id}`;
  if (existsSync("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes")) {
    assert.ok(existsSync(`${dir}/memory.memsw.limit_in_bytes`), "the machine has its own memory cgroup");
    assert.equal(readFileSync(`${dir}/memory.limit_in_bytes`, "utf8").trim(), String(256 * 1024 * 1024));
    assert.equal(readFileSync(`${dir}/memory.memsw.limit_in_bytes`, "utf8").trim(), String(256 * 1024 * 1024), "memory + swap is bounded by the same limit");
  }
  await destroy(m.id);
});

test("a machine that dies of memory says so: failure_reason is out of memory", async () => {
  const m = await create({ memory_mb: 128 });
  const slirp = Number(readFileSync(`${k.dataDir}/machines/${m.id}/slirp.pid`, "utf8"));
  // The OOM killer takes the largest process of those with the highest oom_score_adj: raised to the top, the guest
  // agent (tens of MiB) goes before the many small ones that fill the machine, and the machine itself dies.
  // Machine root cannot touch the agent (not dumpable: under runc its /proc files belong to host root), so the host
  // raises it; under gVisor the host sees only the sandbox, and the machine's own root still can.
  const procs = `/sys/fs/cgroup/pids/kiln/${m.id}/cgroup.procs`;
  for (const pid of existsSync(procs) ? readFileSync(procs, "utf8").split("\n").filter(Boolean) : []) {
    if (readFileSync(`/proc/${pid}/cmdline`, "utf8").includes("agent.cjs")) writeFileSync(`/proc/${pid}/oom_score_adj`, "1000");
  }
  const storm = "for p in /proc/[0-9]*; do grep -qs agent.cjs $p/cmdline && echo 1000 2>/dev/null > $p/oom_score_adj; done; for i in $(seq 40); do perl -e '$x = \"a\" x 6000000; sleep 60' & done; wait";
  await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: storm, user: "root", timeout_s: 30 } });
  let view = (await k.call("GET", `/v1/machines/${m.id}`)).body;
  for (let i = 0; i < 100 && view.status !== "destroyed"; i++) {
    await k.kiln.services.machines.reapDead();
    await new Promise((r) => setTimeout(r, 200));
    view = (await k.call("GET", `/v1/machines/${m.id}`)).body;
  }
  assert.equal(view.status, "destroyed");
  assert.equal(view.failure_reason, "out of memory");
  // The reaper's destroy removes the machine's remains behind it (teardown.ts).
  assert.equal(await k.kiln.services.machines.cleanupsSettled(60_000), true);
  assertNothingLeft(m.id, slirp);
});

test("after kill -9 of the server and a restart, nothing of a machine gone meanwhile is left: loop device, mount, cgroups, rules", async () => {
  // A real server process, killed with SIGKILL: no close() runs, so machines, spare disks and rules stay as they were.
  const dir = await mkdtemp(join(tmpdir(), "kiln-test-kill9-"));
  await chmod(dir, 0o711); // machine root must be able to reach the data dir inside it
  const data = join(dir, "data");
  const script = join(dir, "serve.ts");
  await writeFile(
    script,
    `import { startTestKiln } from ${JSON.stringify(join(import.meta.dirname, "../support/kiln.ts"))};
const k = await startTestKiln({ dataDir: process.argv[2], env: { KILN_WARM_POOL: "1" } });
const ids = [];
for (const network of [{ allow_out: ["10.9.9.9"] }, { allow_out: ["10.8.8.8"] }]) {
  const res = await k.call("POST", "/v1/machines", { body: { template: "local/base", network } });
  if (res.status !== 201) {
    process.stderr.write(res.status + " " + res.text + "\\n" + k.logs.slice(-5).join(""));
    process.exit(1);
  }
  ids.push(res.body.id);
}
const pool = k.kiln.services.pool;
for (let i = 0; i < 400 && pool.stats().ready === 0; i++) await new Promise((r) => setTimeout(r, 50));
process.stdout.write(JSON.stringify({ ids, pooled: pool.stats().ids }) + "\\n");
setInterval(() => {}, 1000);
`,
  );
  const child = spawn(process.execPath, [script, data], { stdio: ["ignore", "pipe", "pipe"], env: process.env });
  let next: TestKiln | undefined;
  try {
    const first = await new Promise<string>((resolve, reject) => {
      let out = "";
      let err = "";
      child.stderr.on("data", (d: Buffer) => (err += d.toString()));
      child.stdout.on("data", (d: Buffer) => {
        out += d.toString();
        if (out.includes("\n")) resolve(out.split("\n")[0]);
      });
      child.once("exit", (code) => reject(new Error(`the server exited ${code} before it was ready: ${err.slice(-2000)}`)));
    });
    const { ids, pooled } = JSON.parse(first) as { ids: string[]; pooled: string[] };
    const [keep, gone] = ids;
    const slirp = (id: string) => Number(readFileSync(`${data}/machines/${id}/slirp.pid`, "utf8"));
    const goneSlirp = slirp(gone);
    const orphanSlirp = pooled.length ? slirp(pooled[0]) : undefined;
    child.kill("SIGKILL");
    await new Promise((r) => child.once("exit", r));
    process.kill(Number(readFileSync(`${data}/machines/${gone}/runtime.pid`, "utf8")), "SIGKILL");
    await new Promise((r) => setTimeout(r, 300));

    next = await startTestKiln({ dataDir: data, env: { KILN_WARM_POOL: "1" } });
    assert.equal((await next.call("GET", `/v1/machines/${keep}`)).body.status, "running");
    assert.ok(nft("list", "table", "inet", "kiln").includes(keep), "the live machine keeps its rules across the restart");
    assert.equal((await next.call("GET", `/v1/machines/${gone}`)).body.status, "destroyed");
    assertNothingLeftIn(next, gone, goneSlirp);
    if (pooled.length) assertNothingLeftIn(next, pooled[0], orphanSlirp); // a pooled machine had no record: an orphan
    await next.close();
    next = undefined;
    assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(data), "nothing of the data dir stays mounted (spare disks included)");
    assert.ok(!execFileSync("losetup", ["-a"], { encoding: "utf8" }).includes(data), "no loop device of the data dir is left");
    assert.ok(!nft("list", "table", "inet", "kiln").includes(keep));
  } finally {
    if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
    // Whatever happened, a server over the data dir destroys what is left (close removes the data dir).
    await (next ?? (await startTestKiln({ dataDir: data, env: { KILN_WARM_POOL: "0" } }))).close();
    await rm(dir, { recursive: true, force: true });
  }
});
