// Kiln writes with umask 077, yet what it makes *for* machines and images stays readable by their non-root users:
// a Dockerfile build's COPY keeps the context's implied directories 0755 (a RUN as a non-root uid reads them), and
// a machine's runtime-made cgroup is readable inside it (its OOM counter reports an OOM kill).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { pushImage, registryAvailable, startRegistry } from "../support/oci-registry.ts";
import type { TestRegistry } from "../support/oci-registry.ts";
import { hostArchSupported, shellRootfs } from "../support/mini-rootfs.ts";
import { build, putBlob } from "../builds/support.ts";
import { TEST_RUNTIME } from "../support/paths.ts";

function skipReason(): string | undefined {
  const r = registryAvailable();
  if (r) return r;
  if (!hostArchSupported()) return "the mini rootfs is copied from an x86-64 host";
  if (spawnSync("buildah", ["--version"]).status !== 0) return "buildah is not installed (scripts/up.sh installs it)";
  return undefined;
}
const skip = skipReason();

let k: TestKiln;
let reg: TestRegistry | undefined;
before(async () => {
  if (!skip) {
    reg = await startRegistry();
    await pushImage(reg, "mini/shell", "v1", { layers: [{ entries: shellRootfs() }] });
  }
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0", ...(reg ? { KILN_INSECURE_REGISTRIES: reg.host } : {}) } });
  assert.equal(process.umask(), 0o077, "the server set Kiln's umask for this process");
});
after(async () => {
  await k?.close();
  await reg?.stop();
});

test("a Dockerfile COPY of context directories is readable by a non-root RUN: the implied directories are 0755", { skip }, async () => {
  const blob = await putBlob(k, "from the context\n");
  const r = await build(k, {
    name: "umask-copy",
    dockerfile: `FROM ${reg!.host}/mini/shell:v1\nCOPY app/ /opt/app/\nCOPY . /opt/all/\nUSER 1000\nRUN cat /opt/app/sub/main.txt /opt/all/app/sub/main.txt\n`,
    context: { files: [{ path: "app/sub/main.txt", sha256: blob, mode: "0644" }] },
  });
  assert.equal(r.status, 200, r.raw);
  assert.equal(r.events.at(-1)?.event, "end", r.events.slice(-6).map((e) => e.data.message).join("\n"));
  assert.equal(r.events.filter((e) => e.data.message === "from the context").length, 2, "the non-root RUN read both copies");
});

test("a machine's own cgroup is readable inside it: an OOM kill is reported as oom_killed", { skip: TEST_RUNTIME === "runsc" && "gVisor enforces the memory limit on the whole sandbox" }, async () => {
  const m = await k.call("POST", "/v1/machines", { body: { memory_mb: 256 } });
  assert.equal(m.status, 201, m.text);
  const res = await k.call("POST", `/v1/machines/${m.body.id}/exec`, { body: { cmd: "tail", args: ["/dev/zero"], timeout_s: 120 } });
  assert.equal(res.status, 200, res.text);
  assert.equal(res.body.signal, "SIGKILL");
  assert.equal(res.body.oom_killed, true);
  await k.call("DELETE", `/v1/machines/${m.body.id}`);
});
