// Build layers captured from machines on their own uid ranges are what they were on the shared range: the same
// template built on a server of each kind gives layers with the same files, owners, modes, set-id bits, whiteouts,
// opaque dirs, xattrs and file capabilities, and machines from them behave alike (ping's capability included).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { readdirSync } from "node:fs";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { buildOk } from "../builds/support.ts";

let perMachine: TestKiln;
let shared: TestKiln;
before(async () => {
  [perMachine, shared] = await Promise.all([
    startTestKiln({ env: { KILN_WARM_POOL: "0" } }),
    startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_MACHINE_IDENTITY: "shared" } }),
  ]);
});
after(async () => {
  await Promise.all([perMachine?.close(), shared?.close()]);
});

const STEPS = [
  {
    type: "run",
    command: [
      "set -e",
      "mkdir -p /srv/t/sub && echo hi > /srv/t/f && chown 1000:1000 /srv/t/f && chmod 2775 /srv/t/sub && chown 0:1000 /srv/t/sub",
      "ln -s ../f /srv/t/sub/link && mkfifo /srv/t/fifo && cp /bin/true /srv/t/suid && chmod 4755 /srv/t/suid",
      // A whiteout (a template file removed) and an opaque dir (a template dir removed and made again).
      "rm /etc/issue && rm -rf /usr/share/doc/bash && mkdir /usr/share/doc/bash && echo new > /usr/share/doc/bash/x",
      "python3 -c \"import os, struct; os.setxattr('/srv/t/f', 'user.kiln', b'v'); os.system('cp /bin/true /srv/t/capped'); os.setxattr('/srv/t/capped', 'security.capability', struct.pack('<IIIII', 0x02000001, 1 << 13, 0, 0, 0))\"",
    ].join("\n"),
  },
  // Its postinst gives /bin/ping cap_net_raw (setcap) inside the build machine.
  { type: "apt_install", packages: ["iputils-ping"] },
  { type: "user", user: "user" },
  { type: "run", command: "mkdir /home/user/d && echo mine > /home/user/d/f && chmod 600 /home/user/d/f" },
];

/** Every entry of a layer dir: type, owner, mode, size, content hash or link target, device number, xattrs. */
function tree(dir: string): string {
  const walker = `
import hashlib, json, os, stat, sys
root = sys.argv[1]
for base, dirs, files in os.walk(root):
    dirs.sort()
    for name in [""] + sorted(dirs + files):
        p = os.path.join(base, name) if name else base
        if name == "" and base != root:
            continue
        st = os.lstat(p)
        e = {"path": os.path.relpath(p, root), "type": stat.S_IFMT(st.st_mode), "mode": oct(stat.S_IMODE(st.st_mode)), "uid": st.st_uid, "gid": st.st_gid}
        if stat.S_ISREG(st.st_mode):
            e["size"] = st.st_size
            e["sha256"] = hashlib.sha256(open(p, "rb").read()).hexdigest()
        if stat.S_ISLNK(st.st_mode):
            e["target"] = os.readlink(p)
        if stat.S_ISCHR(st.st_mode):
            e["rdev"] = st.st_rdev
        # trusted.overlay.uuid is a random id of the overlay mount the layer was captured from: any two builds differ.
        e["xattrs"] = {k: os.getxattr(p, k, follow_symlinks=False).hex() for k in sorted(os.listxattr(p, follow_symlinks=False)) if k != "trusted.overlay.uuid"}
        print(json.dumps(e, sort_keys=True))
`;
  return execFileSync("/usr/bin/python3", ["-c", walker, dir], { encoding: "utf8", maxBuffer: 256 * 1024 * 1024 });
}

/** A tree listing without what differs between any two builds of one step: content, sizes, overlay origin handles. */
function withoutBuildNoise(listing: string): string {
  return listing
    .trim()
    .split("\n")
    .map((line) => {
      const { sha256: _sha, size: _size, ...e } = JSON.parse(line) as Record<string, unknown> & { xattrs: Record<string, string> };
      delete e.xattrs["trusted.overlay.origin"];
      return JSON.stringify(e);
    })
    .join("\n");
}

/** The captured layers of a server's builds, by the step cache key their directory name starts with. */
function layers(server: TestKiln): Map<string, string> {
  const dir = join(server.dataDir, "layers");
  return new Map(readdirSync(dir).map((name) => [name.split("-")[0], join(dir, name)]));
}

test("the same template built on its own uid ranges and on the shared range gives identical layers and machines", async () => {
  const [mine, before] = await Promise.all([
    buildOk(perMachine, { name: "ids-layers", steps: STEPS }),
    buildOk(shared, { name: "ids-layers", steps: STEPS }),
  ]);
  assert.ok(mine.artifactId && before.artifactId);
  const a = layers(perMachine);
  const b = layers(shared);
  assert.deepEqual([...a.keys()].sort(), [...b.keys()].sort(), "the same steps were captured, under the same cache keys");
  assert.ok(a.size >= 3, `layers captured: ${a.size}`);
  for (const [key, dir] of a) {
    const ours = tree(dir);
    const theirs = tree(b.get(key)!);
    if (/"path": "var\//.test(ours)) {
      // apt's layer differs between any two builds (its caches and logs carry times; copied-up dirs of the step
      // before have new inodes, so their overlay origin handles do): there, everything but those must match.
      assert.equal(withoutBuildNoise(ours), withoutBuildNoise(theirs), `layer ${key} differs`);
    } else assert.equal(ours, theirs, `layer ${key} differs`);
    // The layer is in the canonical range; whiteouts are overlayfs' own, made by host root (as before).
    for (const line of ours.trim().split("\n")) {
      const e = JSON.parse(line);
      if (e.type === 0o20000 && e.rdev === 0) assert.equal(e.uid, 0);
      else assert.ok(e.uid >= 100_000 && e.uid < 165_536, `${e.path} is stored in the canonical range (uid ${e.uid})`);
    }
  }
  const all = [...a.values()].map(tree).join("");
  assert.match(all, /"path": "etc\/issue", "rdev": 0, "type": 8192/, "a whiteout for the removed file");
  assert.match(all, /"path": "usr\/share\/doc\/bash", "type": 16384, "uid": 100000, "xattrs": \{"trusted.overlay.opaque": "79"\}/, "an opaque dir");
  assert.match(all, /"path": "srv\/t\/suid", "sha256": "[0-9a-f]+", "size": \d+, "type": 32768, "uid": 100000, "xattrs": \{\}\}/);
  assert.match(all, /"mode": "0o4755", "path": "srv\/t\/suid"/);
  // File capabilities keyed to the canonical root (100000): valid for root of whichever range a machine runs on.
  assert.match(all, /"path": "srv\/t\/capped"[^\n]*"security.capability": "[0-9a-f]{40}a0860100"/);
  assert.match(all, /"path": "usr\/bin\/ping"[^\n]*"security.capability": "[0-9a-f]{40}a0860100"/);

  // Machines from the two templates see the same files and get the same from ping.
  const probe = [
    "stat -c '%U:%G %a %n' /srv/t/f /srv/t/sub /srv/t/suid /home/user/d /home/user/d/f /usr/bin/ping",
    "test -e /etc/issue && echo issue-still-there; ls /usr/share/doc/bash",
    "python3 -c \"import os; print(os.getxattr('/usr/bin/ping', 'security.capability').hex(), os.getxattr('/srv/t/f', 'user.kiln'))\"",
    "ping -c1 -W2 127.0.0.1 >/dev/null 2>&1; echo ping=$?",
  ].join("; ");
  const outputs: string[] = [];
  for (const server of [perMachine, shared]) {
    const m = await server.call("POST", "/v1/machines", { body: { template: "ids-layers" } });
    assert.equal(m.status, 201, m.text);
    const r = await server.call("POST", `/v1/machines/${m.body.id}/exec`, { body: { cmd: probe, user: "user" } });
    assert.equal(r.status, 200, r.text);
    outputs.push(r.body.stdout);
  }
  assert.equal(outputs[0], outputs[1]);
  assert.match(outputs[0], /^user:user 644 \/srv\/t\/f\nroot:user 2775 \/srv\/t\/sub\nroot:root 4755 \/srv\/t\/suid\nuser:user 755 \/home\/user\/d\nuser:user 600 \/home\/user\/d\/f\nroot:root 755 \/usr\/bin\/ping\nx\n/);
  assert.match(outputs[0], /^0100000200200000[0]{24} b'v'$/m, "ping's capability reads back for this machine's root");
  // As before: no_new_privileges keeps the file capability from raising user's ping (it fails alike on both ranges)…
  assert.match(outputs[0], /^ping=2$/m);
  // …while machine root, who holds CAP_NET_RAW in its namespace, pings.
  for (const server of [perMachine, shared]) {
    const id = (await server.call("GET", "/v1/machines")).body.machines[0].id;
    const r = await server.call("POST", `/v1/machines/${id}/exec`, { body: { cmd: "ping -c1 -W2 127.0.0.1 >/dev/null 2>&1; echo ping=$?", user: "root" } });
    assert.equal(r.body.stdout, "ping=0\n");
  }
});
