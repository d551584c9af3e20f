// Configuration: defaults from DESIGN.md §2, and a clear message naming the variable for a bad value.

import { test } from "node:test";
import assert from "node:assert/strict";
import { ConfigError, loadConfig } from "../src/config.ts";

test("defaults", () => {
  const c = loadConfig({});
  assert.equal(c.host, "127.0.0.1");
  assert.equal(c.port, 8080);
  assert.match(c.dataDir, /\.kiln$/);
  assert.equal(c.databaseUrl, undefined);
  assert.equal(c.driver, "oci");
  assert.equal(c.ociRuntime, "runc");
  assert.equal(c.machineHostAccess, false);
  assert.equal(c.wsPingIntervalMs, 15_000);
  assert.equal(c.runscPlatform, "ptrace");
  assert.equal(c.snapshotSpares, 4);
  assert.equal(c.edgeDomain, undefined, "no edge domain: the path form on KILN_PUBLIC_URL");
  assert.deepEqual(loadConfig({ KILN_EDGE_DOMAIN: "Edge.Example.com" }).edgeDomain, { host: "edge.example.com", port: undefined });
  // The base pool follows demand unless told otherwise.
  assert.equal(c.warmPoolMax, "auto");
  assert.equal(c.warmPoolIdleMs, 60_000);
  assert.equal(loadConfig({ KILN_WARM_POOL_MAX: "auto" }).warmPoolMax, "auto");
  assert.equal(loadConfig({ KILN_WARM_POOL_MAX: "0" }).warmPoolMax, 0);
  assert.equal(loadConfig({ KILN_WARM_POOL_MAX: "20" }).warmPoolMax, 20);
});

for (const [name, value, pattern] of [
  ["KILN_PORT", "eighty", /KILN_PORT/],
  ["KILN_PORT", "70000", /KILN_PORT/],
  ["KILN_OCI_RUNTIME", "crun", /KILN_OCI_RUNTIME must be one of runc, runsc/],
  ["KILN_RUNSC_PLATFORM", "tcg", /KILN_RUNSC_PLATFORM must be one of ptrace, systrap, kvm/],
  ["KILN_DATABASE_URL", "mysql://x", /KILN_DATABASE_URL/],
  ["KILN_MACHINE_HOST_ACCESS", "maybe", /KILN_MACHINE_HOST_ACCESS/],
  ["KILN_API_KEY", "short", /KILN_API_KEY/],
  ["KILN_INSECURE_REGISTRIES", "http://127.0.0.1:5000", /KILN_INSECURE_REGISTRIES/],
  ["KILN_EDGE_DOMAIN", "https://edge.example.com", /KILN_EDGE_DOMAIN/],
  ["KILN_EDGE_DOMAIN", "10.0.0.1", /KILN_EDGE_DOMAIN/],
  ["KILN_WARM_POOL_MAX", "lots", /KILN_WARM_POOL_MAX must be auto or an integer/],
  ["KILN_WARM_POOL_MAX", "257", /KILN_WARM_POOL_MAX/],
  ["KILN_WARM_POOL_IDLE_S", "0", /KILN_WARM_POOL_IDLE_S/],
  ["KILN_SNAPSHOT_SPARES", "65", /KILN_SNAPSHOT_SPARES/],
] as const) {
  test(`${name}=${value} is refused with a message naming it`, () => {
    assert.throws(() => loadConfig({ [name]: value }), (err: unknown) => err instanceof ConfigError && pattern.test(err.message));
  });
}

test("a bad database URL never echoes its password", () => {
  assert.throws(() => loadConfig({ KILN_DATABASE_URL: "mysql://u:hunter2@db/x" }), (err: unknown) => !(err as Error).message.includes("hunter2"));
});

test("KILN_INSECURE_REGISTRIES lists the registry hosts reached over plain HTTP", () => {
  assert.deepEqual(loadConfig({}).insecureRegistries, []);
  assert.deepEqual(loadConfig({ KILN_INSECURE_REGISTRIES: "127.0.0.1:5000, registry.lan" }).insecureRegistries, ["127.0.0.1:5000", "registry.lan"]);
  assert.equal(loadConfig({}).buildkitHost, undefined, "Dockerfile builds use Buildah unless BUILDKIT_HOST names a daemon");
  assert.equal(loadConfig({ BUILDKIT_HOST: "unix:///run/buildkit/buildkitd.sock" }).buildkitHost, "unix:///run/buildkit/buildkitd.sock");
});
