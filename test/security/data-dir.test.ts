// The data dir is private: after real traffic (a machine, a webhook with a secret, a build, a volume), an
// unprivileged host user (`nobody`, through setpriv) can read no file and list no directory in it — not even by a
// path learned from /proc/mounts — while the machines themselves still read what they need. An existing data dir
// left readable is tightened at the next start.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { chmodSync, existsSync, lstatSync, readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { createServer } from "node:http";
import type { Server } from "node:http";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { putBlob, buildOk } from "../builds/support.ts";

const MARKER = `kiln-private-${process.pid}-${Date.now()}`;

let k: TestKiln;
let receiver: Server;
let machineId: string;
let volumeId: string;
let webhookSecret: string;

before(async () => {
  receiver = createServer((_req, res) => res.end("ok"));
  await new Promise<void>((r) => receiver.listen(0, "127.0.0.1", r));
  const rxPort = (receiver.address() as { port: number }).port;
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_WEBHOOK_ALLOW_PRIVATE: "1" } });

  const hook = await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: `http://127.0.0.1:${rxPort}/hook`, operations: ["create", "destroy"] } });
  assert.equal(hook.status, 201, hook.text);
  webhookSecret = hook.body.signing_secret;
  assert.ok(webhookSecret);

  const vol = await k.call("POST", "/v1/volumes", { body: { name: "private-vol", size_mb: 64 } });
  assert.equal(vol.status, 201, vol.text);
  volumeId = vol.body.id;
  const put = await k.call("PUT", `/v1/volumes/${volumeId}/files?path=/notes/marker.txt`, { raw: MARKER + "\n", headers: { "content-type": "application/octet-stream" } });
  assert.equal(put.status, 200, put.text);

  const blob = await putBlob(k, `context ${MARKER}\n`);
  await buildOk(k, {
    name: "private-build",
    context: { files: [{ path: "ctx/marker.txt", sha256: blob }] },
    steps: [
      { type: "copy", src: "ctx/", dest: "/opt/ctx/" },
      { type: "run", command: `mkdir -p /opt/made && echo ${MARKER} > /opt/made/by-run.txt` },
    ],
  });

  const m = await k.call("POST", "/v1/machines", { body: { template: "private-build", volumes: [{ volume_id: volumeId, path: "/data" }] } });
  assert.equal(m.status, 201, m.text);
  machineId = m.body.id;
  const w = await sh(`echo ${MARKER} > /home/user/marker.txt && chmod 644 /home/user/marker.txt`);
  assert.equal(w.exit_code, 0, w.stderr);
});
after(async () => {
  try {
    await k?.close();
  } finally {
    receiver?.closeAllConnections();
    await new Promise((r) => receiver?.close(r));
  }
});

async function sh(cmd: string, user = "user") {
  const res = await k.call("POST", `/v1/machines/${machineId}/exec`, { body: { cmd, user } });
  assert.equal(res.status, 200, res.text);
  return res.body as { exit_code: number; stdout: string; stderr: string };
}

/** Mount points under `dir`, as any host user can read them from /proc/self/mountinfo. */
function mountsUnder(dir: string): string[] {
  return readFileSync("/proc/self/mountinfo", "utf8")
    .split("\n")
    .map((l) => l.split(" ")[4])
    .filter((p): p is string => p !== undefined && p.startsWith(dir + "/"));
}

/**
 * Every path in the data dir (walked as root, never into a mount), plus paths inside the mounts that an attacker
 * could learn or guess (the machine's files, the volume's, the secrets' names).
 */
function candidatePaths(): string[] {
  // The disk pool (an XFS file mounted at disks/ on hosts whose data dir cannot reflink) is Kiln's own: walked too.
  const mounts = new Set(mountsUnder(k.dataDir).filter((m) => m !== join(k.dataDir, "disks")));
  const out: string[] = [k.dataDir];
  const walk = (dir: string) => {
    for (const name of readdirSync(dir)) {
      const p = join(dir, name);
      out.push(p);
      const st = lstatSync(p);
      if (st.isDirectory() && !mounts.has(p)) walk(p);
    }
  };
  walk(k.dataDir);
  for (const m of mounts) out.push(m, join(m, "etc/passwd"), join(m, "home/user/marker.txt"), join(m, "notes/marker.txt"), join(m, "upper/home/user/marker.txt"), join(m, "opt/made/by-run.txt"));
  return [...new Set(out)];
}

/** What `nobody` (uid and gid 65534, no groups) can read or list among `paths`. */
function readableByNobody(paths: string[]): string[] {
  const script = 'while IFS= read -r p; do if [ -d "$p" ]; then ls -- "$p" >/dev/null 2>&1 && echo "LIST $p"; else head -c1 -- "$p" >/dev/null 2>&1 && echo "READ $p"; fi; done; echo done';
  const r = spawnSync("setpriv", ["--reuid=65534", "--regid=65534", "--clear-groups", "--", "/bin/sh", "-c", script], { input: paths.join("\n") + "\n", encoding: "utf8" });
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, /done\n$/, "the walker ran to the end");
  return r.stdout.split("\n").filter((l) => l.startsWith("LIST ") || l.startsWith("READ "));
}

test("the probe can see: as nobody it reads a world-readable file and lists a world-readable dir outside the data dir", () => {
  assert.deepEqual(readableByNobody(["/etc/hostname", "/usr"]), ["READ /etc/hostname", "LIST /usr"]);
});

test("after a machine, a webhook with a secret, a build and a volume, nobody can read or list anything in the data dir", () => {
  const paths = candidatePaths();
  assert.ok(paths.some((p) => p.endsWith("kiln.db")), "the store is among the paths tried");
  assert.ok(paths.some((p) => p.endsWith(`${machineId}.img`)), "a machine's disk image is among the paths tried");
  assert.ok(paths.some((p) => p.includes("/volumes/")), "the volume is among the paths tried");
  assert.ok(paths.some((p) => p.includes("/blobs/")), "the build context's blobs are among the paths tried");
  assert.ok(paths.length > 30, `${paths.length} paths`);
  assert.deepEqual(readableByNobody(paths), []);
});

test("the data dir and what holds secrets have private modes: dir 0711, store and WAL 0600, disk images 0600", () => {
  assert.equal(statSync(k.dataDir).mode & 0o777, 0o711);
  for (const f of ["kiln.db", "kiln.db-wal", "edge-secret"]) {
    const p = join(k.dataDir, f);
    assert.ok(existsSync(p), f);
    assert.equal(statSync(p).mode & 0o077, 0, `${f} is ${(statSync(p).mode & 0o777).toString(8)}`);
  }
  const images = candidatePaths().filter((p) => p.endsWith(".img") || p.endsWith(".ext4"));
  assert.ok(images.length >= 2, images.join(" "));
  for (const p of images) assert.equal(statSync(p).mode & 0o077, 0, `${p} is ${(statSync(p).mode & 0o777).toString(8)}`);
  // The webhook's signing secret is in the store, and the store is the only place on disk it is.
  assert.ok(readFileSync(join(k.dataDir, "kiln.db")).includes(webhookSecret) || readFileSync(join(k.dataDir, "kiln.db-wal")).includes(webhookSecret));
});

test("the machines still read what they need: /etc files, the guest runtime, the build's files, the volume", async () => {
  const r = await sh(`cat /etc/hosts >/dev/null && cat /etc/resolv.conf >/dev/null && /opt/kiln/bin/tini --version >/dev/null && cat /opt/ctx/marker.txt /opt/made/by-run.txt /data/notes/marker.txt && python3 -c 'print(1)' && ls / >/dev/null && touch /data/notes/by-user && id -un`);
  assert.equal(r.exit_code, 0, r.stderr);
  assert.equal(r.stdout, `context ${MARKER}\n${MARKER}\n${MARKER}\n1\nuser\n`);
});

test("an existing data dir left readable is tightened at the next start, and its machine still works", async () => {
  await k.stop();
  // What an older Kiln (umask 022) left behind.
  const disk = candidatePaths().find((p) => p.endsWith(`${machineId}.img`))!;
  const blob = candidatePaths().find((p) => p.includes("/blobs/") && statSync(p).isFile())!;
  chmodSync(k.dataDir, 0o755);
  // (The WAL is gone: a clean stop checkpoints it into the store.)
  for (const f of ["kiln.db", "host-id", "edge-secret"]) chmodSync(join(k.dataDir, f), 0o644);
  chmodSync(join(k.dataDir, "blobs"), 0o755);
  chmodSync(blob, 0o644);
  chmodSync(join(k.dataDir, "machines", machineId), 0o755);
  chmodSync(join(k.dataDir, "machines", machineId, "disk"), 0o755);
  chmodSync(disk, 0o644);
  chmodSync(join(k.dataDir, "disks"), 0o755);
  chmodSync(join(k.dataDir, "disks", "machines"), 0o755);
  chmodSync(join(k.dataDir, "volumes", volumeId), 0o755);
  const loose = readableByNobody(candidatePaths());
  assert.ok(loose.some((l) => l.endsWith("kiln.db")), `the loosened store is readable before the restart: ${loose.join(", ")}`);

  k = await startTestKiln({ dataDir: k.dataDir, env: { KILN_WARM_POOL: "0", KILN_WEBHOOK_ALLOW_PRIVATE: "1" } });
  assert.deepEqual(readableByNobody(candidatePaths()), []);
  assert.equal(statSync(disk).mode & 0o777, 0o600);
  const r = await sh("cat /home/user/marker.txt /data/notes/marker.txt");
  assert.equal(r.stdout, `${MARKER}\n${MARKER}\n`);
});
