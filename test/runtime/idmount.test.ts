// The mount helper on its own: compiled once per source version, its probe telling filesystems with idmapped mounts
// from those without (where machines fall back to the shared range), and the command line a boot runs.

import { test } from "node:test";
import assert from "node:assert/strict";
import { existsSync, statSync } from "node:fs";
import { mkdtemp, readdir, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { bootCommand, prepareIdmountHelper, probeIdmappedMounts } from "../../src/runtime/oci/idmount.ts";

test("the helper is compiled once per source version; the probe tells filesystems with idmapped mounts from those without", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-idmount-"));
  try {
    const helper = await prepareIdmountHelper(dir);
    assert.ok(helper.path, helper.problem);
    const made = statSync(helper.path).mtimeMs;
    assert.equal((await prepareIdmountHelper(dir)).path, helper.path);
    assert.equal(statSync(helper.path).mtimeMs, made, "not compiled again");
    assert.deepEqual((await readdir(dir)).filter((n) => n.endsWith(".partial")), []);
    assert.equal(statSync(helper.path).mode & 0o777, 0o700);

    assert.deepEqual(await probeIdmappedMounts(helper.path, [dir]), { ok: true }, "ext4 (this host's /tmp) takes idmapped mounts");
    // procfs does not: a data dir or layer on such a filesystem makes machines fall back, with the kernel's reason.
    const proc = await probeIdmappedMounts(helper.path, ["/proc"]);
    assert.equal(proc.ok, false);
    assert.match((proc as { problem: string }).problem, /mount_setattr \/proc: Invalid argument/);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test("a boot's command line puts the helper in front of the runtime's, with the machine's namespace, mounts and limits", () => {
  const [cmd, args] = bootCommand(
    "/h",
    {
      userns: { file: "/m/userns", owner: 165536, hostBase: 165536, sysctl: { max_inotify_instances: 96 }, rlimit: { msgqueue: 819200 } },
      idmap: { canonical: 100000, hostBase: 165536, count: 65536 },
      root: { scratch: "/m/idmap", layers: ["/l/a", "/l/b"], disk: "/m/disk/mnt", rootfs: "/m/rootfs" },
      binds: [{ source: "/v/mnt", target: "/m/idmap/v0", readOnly: true }],
      nofile: { soft: 65536, hard: 1048576 },
    },
    ["runc", ["run", "--detach", "kiln-x"]],
  );
  assert.equal(cmd, "/h");
  assert.deepEqual(args, [
    "boot",
    ...["--userns", "/m/userns", "--owner", "165536", "--map", "165536", "--sysctl", "max_inotify_instances=96", "--rlimit", "msgqueue=819200"],
    ...["--idmap", "100000:165536:65536", "--scratch", "/m/idmap", "--disk", "/m/disk/mnt", "--rootfs", "/m/rootfs", "--lower", "/l/a", "--lower", "/l/b"],
    ...["--bind-ro", "/v/mnt", "/m/idmap/v0", "--nofile", "65536:1048576", "--", "runc", "run", "--detach", "kiln-x"],
  ]);
  assert.ok(!existsSync("/m"), "nothing was run");
});
