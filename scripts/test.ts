// `npm test`: makes the base template once for the whole run (cached between runs), typechecks, builds the web
// console, runs every test file with Node's test runner on runc, then every machine suite again on gVisor (runsc).

import { spawnSync } from "node:child_process";
import { readdirSync } from "node:fs";
import { join } from "node:path";
import { ensureBaseTemplate } from "../src/builder/base-template.ts";
import { createLogger } from "../src/log.ts";
import { TEST_CACHE_DIR } from "../test/support/paths.ts";
import { buildConsole } from "../src/console/bundle.ts";

/** Every test that boots machines; the gVisor job runs exactly these. */
const MACHINE_SUITES = [
  "test/runtime/*.test.ts",
  // The CLI's own behaviour does not depend on the runtime (its machine side is covered here by the other suites): the
  // CLI tests run on runc only (cli-tools and the deployments CLI are left out here; those of git and code skip
  // themselves). So do the multi-host cluster tests (test/hosts: placement, forwarding, cluster auth between servers),
  // key revocation closing sockets, the edge proxy's bounds against hostile services, and E2B's file URL signatures.
  // Hot pools (hot-pool.test.ts) run on runc only too: their pooling is the runtime's create, and CI time is tight.
  ...readdirSync("test/machines").filter((f) => f.endsWith(".test.ts") && f !== "cli-tools.test.ts" && f !== "hot-pool.test.ts").map((f) => `test/machines/${f}`),
  "test/gitcode/*.test.ts",
  "test/volumes/volumes.test.ts",
  "test/volumes/watch.test.ts",
  ...readdirSync("test/deployments").filter((f) => f.endsWith(".test.ts") && f !== "cli.test.ts").map((f) => `test/deployments/${f}`),
  "test/oci/machines.test.ts",
  "test/snapshots/*.test.ts",
  "test/builds/checkpoint.test.ts",
  "test/security/edge-proxy.test.ts",
  "test/security/edge-e2b-ports.test.ts",
  "test/security/edge-git.test.ts",
  "test/security/attack-git.test.ts",
  "test/security/attack-edge.test.ts",
  "test/security/identity.test.ts",
  "test/security/identity-restart.test.ts",
  "test/security/quotas.test.ts",
  "test/security/data-dir.test.ts",
  "test/security/private-umask.test.ts",
  "test/security/build-isolation.test.ts",
  "test/security/machine-root.test.ts",
  "test/security/attack-builds.test.ts",
  "test/security/attack-files.test.ts",
  "test/security/attack-kernels.test.ts",
  "test/e2b/snapshots.test.ts",
  "test/e2b/network-volumes.test.ts",
  "test/e2b/envd064.test.ts",
  "test/e2b/metrics.test.ts",
  "test/e2b/code-interpreter-template.test.ts",
];

const started = Date.now();
const log = createLogger({ level: "warn", pretty: false });
const base = await ensureBaseTemplate({
  cacheDir: TEST_CACHE_DIR,
  log,
  onProgress: (line) => process.stderr.write(`[base ${((Date.now() - started) / 1000).toFixed(0)}s] ${line}\n`),
});
process.stderr.write(`base template ${base.created ? "made" : "cached"} at ${base.layerDir} (${((Date.now() - started) / 1000).toFixed(1)} s)\n`);

// Types first: the code runs by type stripping, so nothing else would notice a type error. The console's
// browser code has its own project (DOM types, JSX).
for (const project of [".", "console"]) {
  const tsc = spawnSync(process.execPath, ["node_modules/typescript/bin/tsc", "--noEmit", "-p", project], { stdio: "inherit" });
  if (tsc.status !== 0) {
    process.stderr.write(`typecheck of ${project} failed\n`);
    process.exit(tsc.status ?? 1);
  }
}
// The console the tests drive is the one these sources make now.
await buildConsole();

const files = process.argv.slice(2);
// Every test file is its own process that loads most of src/: V8's compile cache spares each the type stripping and
// compilation of modules another has compiled (≈ 1 s of CPU a process).
process.env.NODE_COMPILE_CACHE ??= join(import.meta.dirname, "..", "node_modules", ".cache", "node-compile-cache");
// The whole suite also checks that the TypeScript SDK's generated types match the served OpenAPI document.
if (files.length === 0) {
  const check = spawnSync(process.execPath, ["scripts/sdk-types.ts", "--check"], { stdio: "inherit", env: { ...process.env, KILN_TEST_CACHE_DIR: TEST_CACHE_DIR } });
  if (check.status !== 0) process.exit(check.status ?? 1);
}
const run = spawnSync(
  process.execPath,
  ["--test", "--test-reporter=spec", "--test-concurrency=2", "--test-timeout=300000", ...(files.length ? files : ["test/**/*.test.ts", "sdk/typescript/test/*.test.ts"])],
  { stdio: "inherit", env: { ...process.env, KILN_TEST_CACHE_DIR: TEST_CACHE_DIR } },
);
if (run.status !== 0 || files.length > 0) process.exit(run.status ?? 1);

// The machine suites again with every machine under gVisor: both runtimes must pass the same tests.
if (spawnSync("runsc", ["--version"]).status === 0) {
  process.stderr.write("\n== the machine suites on gVisor (KILN_OCI_RUNTIME=runsc) ==\n");
  const gvisor = spawnSync(process.execPath, ["--test", "--test-reporter=spec", "--test-concurrency=2", "--test-timeout=300000", ...MACHINE_SUITES], {
    stdio: "inherit",
    env: { ...process.env, KILN_TEST_CACHE_DIR: TEST_CACHE_DIR, KILN_OCI_RUNTIME: "runsc" },
  });
  process.exit(gvisor.status ?? 1);
}
process.stderr.write("\nrunsc (gVisor) is not installed, so the machine suites cannot run on it: run scripts/up.sh first\n");
process.exit(1);
