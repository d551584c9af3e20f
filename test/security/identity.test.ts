// Per-machine identity (issue 18): each machine runs on its own host uid range, so machine root of one is a stranger
// to every other machine's files and processes; template files keep their owners inside, as on the shared range; a
// volume mounted into machines on different ranges is shared with the right owners both ways; and GET /v1/ready
// says what the host enforces. On runc and gVisor.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawnSync } from "node:child_process";
import { readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { TEST_RUNTIME } from "../support/paths.ts";
import { containerName } from "../../src/runtime/oci/driver.ts";
import { CANONICAL_BASE, ID_RANGE } from "../../src/runtime/oci/idmap.ts";

let k: TestKiln;
/** The same server with every machine on the shared range: how machines saw their files before. */
let shared: TestKiln;

before(async () => {
  [k, shared] = await Promise.all([startTestKiln({ env: { KILN_WARM_POOL: "0" } }), startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_MACHINE_IDENTITY: "shared" } })]);
});
after(async () => {
  await Promise.all([k?.close(), shared?.close()]);
});

async function machine(server: TestKiln, body: Record<string, unknown> = {}): Promise<string> {
  const res = await server.call("POST", "/v1/machines", { body });
  assert.equal(res.status, 201, res.text);
  return res.body.id;
}

async function sh(server: TestKiln, id: string, cmd: string, user = "root"): Promise<{ exit_code: number; stdout: string; stderr: string }> {
  const res = await server.call("POST", `/v1/machines/${id}/exec`, { body: { cmd, user } });
  assert.equal(res.status, 200, res.text);
  return res.body;
}

async function ok(server: TestKiln, id: string, cmd: string, user = "root"): Promise<string> {
  const r = await sh(server, id, cmd, user);
  assert.equal(r.exit_code, 0, `${cmd} as ${user}: ${r.stderr}`);
  return r.stdout;
}

/** The host pid of the machine's first process (runc) or sandbox (runsc), from the runtime's own state. */
function hostPid(server: TestKiln, id: string): number {
  const out = execFileSync(TEST_RUNTIME, ["--root", join(server.dataDir, "oci-state", TEST_RUNTIME), "state", containerName(TEST_RUNTIME, id)], { encoding: "utf8" });
  return JSON.parse(out).pid as number;
}

/** A process's real uid and its user namespace's first mapping line, as the host reads them. */
function hostIds(pid: number): { uid: number; map: number[] } {
  const uid = Number(/^Uid:\s+(\d+)/m.exec(readFileSync(`/proc/${pid}/status`, "utf8"))![1]);
  const map = readFileSync(`/proc/${pid}/uid_map`, "utf8").trim().split("\n")[0].trim().split(/\s+/).map(Number);
  return { uid, map };
}

/** Runs a command on the host as `uid` (an unprivileged host uid, no groups). */
function asHostUid(uid: number, cmd: string[]): { status: number | null; stderr: string } {
  const r = spawnSync("setpriv", [`--reuid=${uid}`, `--regid=${uid}`, "--clear-groups", "--", ...cmd], { encoding: "utf8" });
  return { status: r.status, stderr: r.stderr };
}

test("GET /v1/ready says the host runs each machine on its own uid range, through idmapped mounts", async () => {
  const ready = await k.call("GET", "/v1/ready");
  const identity = ready.body.driver.identity;
  // This host (kernel 6.18, ext4) allows idmapped mounts: anything else here is a regression, not a fallback.
  assert.equal(identity.uid_ranges, "per-machine", identity.detail);
  assert.equal(identity.idmapped_mounts, true);
  assert.equal(identity.kernel_quotas, TEST_RUNTIME === "runsc" ? "gvisor" : "per-machine");
  const old = (await shared.call("GET", "/v1/ready")).body.driver.identity;
  assert.equal(old.uid_ranges, "shared");
  assert.equal(old.idmapped_mounts, false);
  assert.match(old.detail, /KILN_MACHINE_IDENTITY=shared/);
});

test("two machines run on disjoint host uid ranges; what each writes belongs on the host to its own range", async () => {
  const [a, b] = await Promise.all([machine(k), machine(k)]);
  const ids = [a, b].map((id) => hostIds(hostPid(k, id)));
  for (const { uid, map } of ids) {
    assert.equal(map[0], 0);
    assert.equal(map[2], ID_RANGE);
    assert.equal(uid, map[1], "the machine's first process runs as its range's root");
    assert.ok(map[1] >= CANONICAL_BASE + ID_RANGE, `a range of its own, not the canonical one files are stored in (${map[1]})`);
    assert.equal((map[1] - CANONICAL_BASE) % ID_RANGE, 0);
  }
  const [baseA, baseB] = ids.map((i) => i.map[1]);
  assert.ok(Math.abs(baseA - baseB) >= ID_RANGE, `disjoint ranges: ${baseA} and ${baseB}`);

  for (const id of [a, b]) {
    await ok(k, id, `echo ${id} > /home/user/mine`, "user");
    await ok(k, id, `echo ${id} > /root/mine; chmod 600 /root/mine`);
  }
  // The host sees each machine's files through its root at its own ids; at rest they are in the canonical range.
  for (const [id, base] of [[a, baseA], [b, baseB]] as const) {
    const root = join(k.dataDir, "machines", id, "rootfs");
    assert.equal(statSync(join(root, "home/user/mine")).uid, base + 1000);
    assert.equal(statSync(join(root, "root/mine")).uid, base);
    const upper = join(k.dataDir, "machines", id, "disk", "mnt", "upper");
    assert.equal(statSync(join(upper, "home/user/mine")).uid, CANONICAL_BASE + 1000);
    assert.equal(statSync(join(upper, "root/mine")).uid, CANONICAL_BASE);
  }
  // Machine root of a (host uid baseA) is a stranger to b's files and processes; b's own root is not.
  const secret = join(k.dataDir, "machines", b, "rootfs", "root", "mine");
  const foreign = asHostUid(baseA, ["cat", secret]);
  assert.notEqual(foreign.status, 0, "machine a's root cannot read machine b's root-only file");
  assert.match(foreign.stderr, /Permission denied/);
  assert.equal(asHostUid(baseB, ["cat", secret]).status, 0, "machine b's root can (the check can pass)");
  const pidB = hostPid(k, b);
  assert.notEqual(asHostUid(baseA, ["kill", "-0", String(pidB)]).status, 0, "machine a's root cannot signal machine b's processes");
  assert.equal(asHostUid(baseB, ["kill", "-0", String(pidB)]).status, 0);
});

/** Owners, modes and set-id bits of template files as a machine sees them. */
const TEMPLATE_VIEW = [
  "stat -c '%U:%G %a %n' / /etc /etc/passwd /etc/shadow /usr/bin/su /usr/bin/passwd /usr/bin/chage /home/user /workspace /tmp /root /var/log",
  "find / -xdev \\( -perm -4000 -o -perm -2000 \\) -type f 2>/dev/null | sort | xargs stat -c '%U:%G %a %n'",
  "id; id user",
].join("; ");

test("template files keep their owners inside: /home/user is user's, system files root's, set-id binaries as before", async () => {
  const [mine, before] = await Promise.all([machine(k), machine(shared)]);
  const view = await ok(k, mine, TEMPLATE_VIEW);
  assert.equal(view, await ok(shared, before, TEMPLATE_VIEW), "the same owners and modes as on the shared range");
  assert.match(view, /^user:user 755 \/home\/user$/m);
  assert.match(view, /^root:root 644 \/etc\/passwd$/m);
  assert.match(view, /^root:shadow 640 \/etc\/shadow$/m);
  assert.match(view, /^root:root 4755 \/usr\/bin\/su$/m);
  assert.match(view, /^user:user 755 \/workspace$/m);
  // What su (setuid root) does for user is what it did before (no_new_privileges keeps set-id bits from raising
  // privileges in either case); root may still become user with it.
  const su = "su -c 'id -u' root </dev/null 2>&1; echo rc=$?";
  assert.equal((await sh(k, mine, su, "user")).stdout, (await sh(shared, before, su, "user")).stdout);
  assert.equal((await ok(k, mine, "su -s /bin/sh -c 'id -un' user")).trim(), "user");
  // Root-owned files stay out of user's reach, user's own are writable.
  assert.notEqual((await sh(k, mine, "echo x >> /etc/passwd", "user")).exit_code, 0);
  assert.equal((await sh(k, mine, "echo x > /home/user/ok && cat /home/user/ok", "user")).stdout, "x\n");
});

test("a file capability set in a machine is stored as on the shared range (canonical root), and read back alike", async () => {
  // cap_net_raw, permitted + effective, in the v2 form a tool writes; the kernel stores it keyed to the namespace's root.
  const script = [
    "import os, struct",
    "os.system('cp /bin/true /root/capped')",
    "os.setxattr('/root/capped', 'security.capability', struct.pack('<IIIII', 0x02000001, 1 << 13, 0, 0, 0))",
    "print(os.getxattr('/root/capped', 'security.capability').hex())",
  ].join("\n");
  const [mine, before] = await Promise.all([machine(k), machine(shared)]);
  const cmd = `python3 -c "${script}" 2>&1; echo rc=$?`;
  const seen = await sh(k, mine, cmd);
  assert.equal(seen.stdout, (await sh(shared, before, cmd)).stdout, "read back the same inside");
  // gVisor refuses security.* xattrs (EOPNOTSUPP) in either case.
  if (TEST_RUNTIME === "runsc") return assert.match(seen.stdout, /Operation not supported/);
  assert.match(seen.stdout, /^0100000200200000[0]{24}\nrc=0\n$/, "inside, the capability reads back as set, for this machine's root");
  const stored = (server: TestKiln, id: string) =>
    execFileSync("getfattr", ["--absolute-names", "-n", "security.capability", "-e", "hex", join(server.dataDir, "machines", id, "disk", "mnt", "upper", "root", "capped")], { encoding: "utf8" });
  const bytes = stored(k, mine);
  assert.equal(bytes, stored(shared, before).replace(join(shared.dataDir, "machines", before), join(k.dataDir, "machines", mine)));
  // v3 with the namespace root's id: the canonical range's 100000 (0x000186a0, little-endian a0860100), not this machine's.
  assert.match(bytes, /^security\.capability=0x[0-9a-f]{40}a0860100$/m);
});

test("a volume mounted into two machines on different ranges is shared with the right owners both ways", async () => {
  const vol = await k.call("POST", "/v1/volumes", { body: { name: "shared-owners", size_mb: 32 } });
  assert.equal(vol.status, 201, vol.text);
  const v = vol.body.id;
  const [a, b, ro] = await Promise.all([
    machine(k, { volumes: [{ volume_id: v, path: "/data" }] }),
    machine(k, { volumes: [{ volume_id: v, path: "/data" }] }),
    machine(k, { volumes: [{ volume_id: v, path: "/data", read_only: true }] }),
  ]);
  assert.notEqual(hostIds(hostPid(k, a)).map[1], hostIds(hostPid(k, b)).map[1]);
  await ok(k, a, "echo from-a > /data/by-user-a && mkdir /data/dir-a && chmod 700 /data/dir-a && echo in > /data/dir-a/f", "user");
  await ok(k, b, "echo from-b > /data/by-root-b && chmod 600 /data/by-root-b");
  await ok(k, b, "echo from-b-user > /data/by-user-b", "user");
  // Each machine sees the other's files with their owners: user's as user, root's as root.
  const listing = "stat -c '%U:%G %a %n' /data /data/by-user-a /data/dir-a /data/by-root-b /data/by-user-b";
  const expected = ["user:user 755 /data", "user:user 644 /data/by-user-a", "user:user 700 /data/dir-a", "root:root 600 /data/by-root-b", "user:user 644 /data/by-user-b", ""].join("\n");
  assert.equal(await ok(k, a, listing), expected);
  assert.equal(await ok(k, b, listing), expected);
  assert.equal(await ok(k, ro, listing), expected);
  // ...and what those owners may do: user of b writes user-of-a's files and enters a's 0700 dir; root-only stays root's.
  assert.equal(await ok(k, b, "cat /data/dir-a/f && echo more >> /data/by-user-a && cat /data/by-user-a", "user"), "in\nfrom-a\nmore\n");
  assert.notEqual((await sh(k, a, "cat /data/by-root-b", "user")).exit_code, 0, "user of a cannot read root's 0600 file");
  assert.equal(await ok(k, a, "cat /data/by-root-b"), "from-b\n", "root of a can");
  assert.notEqual((await sh(k, ro, "touch /data/nope")).exit_code, 0, "the read-only mount refuses writes");
  // At rest the volume holds canonical ids, which the API reports by the machines' names.
  const mount = join(k.dataDir, "volumes", v, "mnt");
  assert.equal(statSync(join(mount, "by-user-a")).uid, CANONICAL_BASE + 1000);
  assert.equal(statSync(join(mount, "by-root-b")).uid, CANONICAL_BASE);
  const info = await k.call("GET", `/v1/volumes/${v}/files/list?path=/`);
  const owners = Object.fromEntries(info.body.entries.map((e: { name: string; owner: string }) => [e.name, e.owner]));
  assert.deepEqual(owners, { "by-user-a": "user", "dir-a": "user", "by-root-b": "root", "by-user-b": "user" });
  // A file the API writes is the machines' user's in every machine.
  assert.equal((await k.call("PUT", `/v1/volumes/${v}/files?path=/from-api`, { raw: "api", headers: { "content-type": "application/octet-stream" } })).status, 200);
  assert.equal(await ok(k, a, "stat -c %U /data/from-api && echo more >> /data/from-api", "user"), "user\n");
  assert.equal(await ok(k, b, "stat -c %U /data/from-api && cat /data/from-api", "user"), "user\napimore\n");
  // Nothing of the machines' idmapped copies is left on the host once they are gone.
  await Promise.all([a, b, ro].map((id) => k.call("DELETE", `/v1/machines/${id}`)));
  const mounts = readFileSync("/proc/self/mountinfo", "utf8");
  for (const id of [a, b, ro]) assert.equal(mounts.includes(join(k.dataDir, "machines", id)), false);
});
