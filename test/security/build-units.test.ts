// The pure parts of Dockerfile build confinement: the spec the runtime shim hands runc whatever Buildah wrote, and
// the build args refused before any stream because the builder would read them as its own settings.

import { test } from "node:test";
import assert from "node:assert/strict";
import { fitSpec } from "../../src/builder/backends/isolation/runtime-shim.ts";
import type { RunPolicy } from "../../src/builder/backends/isolation/runtime-shim.ts";
import { validateDockerfileBuild } from "../../src/builder/backends/buildkit.ts";
import { KilnError } from "../../src/errors.ts";

const policy: RunPolicy = {
  userns: "/s/userns",
  netns: "/s/netns",
  idMap: { containerID: 0, hostID: 1_000_000_000, size: 65_536 },
  cgroupParent: "/kiln/builds/bld-1.2-x",
  memoryBytes: 128 << 20,
  limitSwap: true,
  cpuQuota: 150_000,
  cpuPeriod: 100_000,
  pidsLimit: 2048,
};

test("the shim puts every RUN container in the build's namespaces, id range and cgroup, whatever Buildah wrote", () => {
  const wrote = {
    process: { args: ["/bin/sh", "-c", "x"], oomScoreAdj: -1000 },
    linux: {
      namespaces: [{ type: "pid", path: "/proc/1/ns/pid" }, { type: "network", path: "/proc/1/ns/net" }, { type: "mount" }],
      uidMappings: [{ containerID: 0, hostID: 0, size: 4294967295 }],
      cgroupsPath: "/",
      resources: { devices: [{ allow: false, access: "rwm" }], memory: { limit: -1 }, pids: { limit: 0 } },
      maskedPaths: ["/proc/kcore"],
    },
  };
  const spec = fitSpec(structuredClone(wrote), policy, "buildah-buildah123");
  assert.deepEqual(spec.linux!.namespaces, [
    { type: "pid" },
    { type: "ipc" },
    { type: "uts" },
    { type: "mount" },
    { type: "cgroup" },
    { type: "user", path: "/s/userns" },
    { type: "network", path: "/s/netns" },
  ]);
  assert.deepEqual(spec.linux!.uidMappings, [policy.idMap]);
  assert.deepEqual(spec.linux!.gidMappings, [policy.idMap]);
  assert.equal(spec.linux!.cgroupsPath, "/kiln/builds/bld-1.2-x/buildah-buildah123");
  assert.deepEqual(spec.linux!.resources, {
    devices: [{ allow: false, access: "rwm" }],
    memory: { limit: 128 << 20, swap: 128 << 20 },
    cpu: { quota: 150_000, period: 100_000 },
    pids: { limit: 2048 },
  });
  assert.ok(spec.linux!.maskedPaths!.includes("/proc/keys") && spec.linux!.readonlyPaths!.includes("/proc/sysrq-trigger"));
  assert.equal(spec.process!.oomScoreAdj, 1000);
  assert.throws(() => fitSpec(structuredClone(wrote), policy, "../../escape"), /unexpected container id/);
});

test("build args the builder would read as its own settings, bad names, NUL bytes and oversized ones are invalid_request", () => {
  const base = { dockerfile: "FROM scratch\n" };
  for (const name of ["LD_PRELOAD", "TMPDIR", "PATH", "HOME", "BUILDAH_ISOLATION", "CONTAINERS_CONF", "STORAGE_DRIVER", "REGISTRY_AUTH_FILE", "DOCKER_CONFIG", "GODEBUG", "XDG_RUNTIME_DIR", "SSL_CERT_FILE"]) {
    assert.throws(
      () => validateDockerfileBuild({ ...base, buildArgs: { [name]: "x" } }),
      (e: unknown) => e instanceof KilnError && e.code === "invalid_request" && e.message.includes(name),
      name,
    );
  }
  const bad: Record<string, string>[] = [{ "1X": "x" }, { "A-B": "x" }, { A: "a\0b" }, { BIG: "x".repeat(600 * 1024) }];
  for (const args of bad) {
    assert.throws(() => validateDockerfileBuild({ ...base, buildArgs: args }), (e: unknown) => e instanceof KilnError && e.code === "invalid_request");
  }
  // Ordinary names, Go-looking ones included, are fine.
  for (const name of ["GO_VERSION", "NODE_ENV", "http_proxy", "HTTPS_PROXY", "VERSION"]) validateDockerfileBuild({ ...base, buildArgs: { [name]: "1" } });
});
