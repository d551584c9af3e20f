// Machines boot from imported images: the guest agent is injected, so a rootfs without Node (a shell and libc),
// a distroless one (a single static binary) and one shaped by whiteouts and opaque dirs all run commands.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { chmod, mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { importImage } from "../../src/builder/oci/import.ts";
import { createOciDriver } from "../../src/runtime/oci/driver.ts";
import type { LiveMachine, MachineDriver } from "../../src/runtime/driver.ts";
import { prepareGuestRuntime } from "../../src/runtime/guest-runtime.ts";
import { bundleAgent, AGENT_SOURCES } from "../../src/agent/bundle.ts";
import { createLogger } from "../../src/log.ts";
import { createAgentClient } from "../../src/runtime/agent-client.ts";
import type { AgentClient } from "../../src/runtime/agent-client.ts";
import type { ExecRequest } from "../../src/agent/protocol.ts";
import { TEST_CACHE_DIR, TEST_RUNTIME } from "../support/paths.ts";
import { pushImage, registryAvailable, startRegistry } from "../support/oci-registry.ts";
import type { TestRegistry } from "../support/oci-registry.ts";
import { distrolessRootfs, hostArchSupported, shellRootfs } from "../support/mini-rootfs.ts";

function skipReason(): string | undefined {
  const r = registryAvailable();
  if (r) return r;
  if (!hostArchSupported()) return "the mini rootfs is copied from an x86-64 host";
  try {
    execFileSync(TEST_RUNTIME, ["--version"], { stdio: "ignore" });
  } catch {
    return `${TEST_RUNTIME} is not installed`;
  }
  return undefined;
}
const skip = skipReason();
const opt = { skip };
const log = createLogger({ level: "warn", pretty: false });
let reg: TestRegistry;
let dir: string;
let driver: MachineDriver;
const machines: string[] = [];
const agents: AgentClient[] = [];

before(async () => {
  if (skip) return;
  reg = await startRegistry();
  dir = await mkdtemp(join(tmpdir(), "kiln-oci-machines-"));
  await chmod(dir, 0o755); // machine root (an unprivileged host uid) must reach its rootfs below here
  const guestRuntimeDir = await prepareGuestRuntime({ dir: join(TEST_CACHE_DIR, "guest-runtime"), agentBundle: bundleAgent, agentSources: AGENT_SOURCES });
  driver = createOciDriver({ dataDir: join(dir, "data"), runtime: TEST_RUNTIME, hostAccess: false, log, guestRuntimeDir });
});

after(async () => {
  if (skip) return;
  await Promise.all(agents.map((a) => a.close()));
  for (const id of machines) await driver.destroy(id);
  await driver.close();
  await reg.stop();
  await rm(dir, { recursive: true, force: true });
});

async function boot(ref: string): Promise<{ m: LiveMachine; user: string | undefined; run: (req: ExecRequest) => Promise<string> }> {
  const img = await importImage(`${reg.host}/${ref}`, { cacheDir: join(dir, "cache"), insecureRegistries: [reg.host] });
  const id = `mch_oci${process.pid}x${machines.length}`;
  machines.push(id);
  const m = await driver.create({ id, layers: img.layers.map((l) => l.dir), hostname: "imported", vcpus: 1, memoryMb: 256, internet: false, mounts: [] });
  const agent = createAgentClient(m.agentSocket);
  agents.push(agent);
  return {
    m,
    user: img.config.user,
    async run(req) {
      const r = await agent.exec({ timeout_ms: 20_000, ...req });
      const out = Buffer.from(r.stdout_base64, "base64").toString();
      assert.equal(r.exit_code, 0, `${req.cmd} failed: ${Buffer.from(r.stderr_base64, "base64").toString()}`);
      return out;
    },
  };
}

test("a machine boots from an imported rootfs without Node (a shell and libc) and runs commands", opt, async () => {
  await pushImage(reg, "mini/shell", "v1", {
    layers: [
      { compression: "gzip", entries: shellRootfs() },
      { compression: "zstd", entries: [{ name: "etc/", type: "directory" }, { name: "etc/motd", content: "from an imported image\n" }, { name: "etc/alias", type: "symlink", linkname: "/etc/motd" }] },
    ],
  });
  const { run } = await boot("mini/shell:v1");
  assert.equal(await run({ cmd: "cat /etc/motd" }), "from an imported image\n");
  assert.equal(await run({ cmd: "cat /etc/alias" }), "from an imported image\n", "an absolute symlink resolves inside the machine");
  assert.match(await run({ cmd: "cat /etc/passwd" }), /^root:x:0:0:/, "Kiln's top layer supplies root when the image has no passwd");
  assert.equal(await run({ cmd: "for p in /usr/bin/node /usr/local/bin/node /bin/node; do test -e $p && echo $p; done; echo none" }), "none\n");
  assert.equal((await run({ cmd: "cat /etc/hostname" })).trim(), "imported");
});

test("a distroless image (one static binary, no shell) boots and runs its program", opt, async () => {
  await pushImage(reg, "mini/distroless", "v1", { layers: [{ compression: "none", entries: distrolessRootfs() }] });
  const { run } = await boot("mini/distroless:v1");
  assert.match(await run({ cmd: "/tini", args: ["--version"] }), /tini version/);
});

test("whiteouts and an opaque directory across layers are what the machine sees", opt, async () => {
  await pushImage(reg, "mini/whiteouts", "v1", {
    layers: [
      { entries: shellRootfs() },
      { entries: [{ name: "a/keep", content: "k" }, { name: "a/gone", content: "g" }, { name: "b/old", content: "o" }, { name: "d/x", content: "x" }] },
      { entries: [{ name: "a/.wh.gone", content: "" }, { name: "b/", type: "directory" }, { name: "b/.wh..wh..opq", content: "" }, { name: "b/new", content: "n" }, { name: ".wh.d", content: "" }] },
      { entries: [{ name: "d/", type: "directory" }, { name: "d/again", content: "again" }, { name: "hard", content: "h" }, { name: "hard2", type: "link", linkname: "hard" }] },
    ],
  });
  const { run } = await boot("mini/whiteouts:v1");
  assert.equal(await run({ cmd: "echo /a/* /b/* /d/*" }), "/a/keep /b/new /d/again\n");
  assert.equal(await run({ cmd: "cat /hard2" }), "h");
});

test("a machine runs commands as the image's User, by the name the import resolved", opt, async () => {
  const passwd = "root:x:0:0:root:/root:/bin/sh\napp:x:1001:1002:app:/:/bin/sh\n";
  for (const [tag, user, ids] of [["named", "app", "1001 1002"], ["numeric", "4242:4343", "4242 4343"]] as const) {
    await pushImage(reg, "mini/user", tag, { layers: [{ entries: shellRootfs() }, { entries: [{ name: "etc/passwd", content: passwd }, { name: "etc/group", content: "root:x:0:\n" }] }], config: { User: user } });
    const { run, user: name } = await boot(`mini/user:${tag}`);
    const status = await run({ cmd: "while read k v rest; do case $k in Uid:|Gid:) printf '%s ' $v;; esac; done < /proc/self/status", user: name });
    assert.equal(status.trim(), ids, `User ${user} → ${name}`);
  }
});
