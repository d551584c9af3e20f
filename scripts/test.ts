// `npm test`: makes the base template once for the whole run (cached between runs), then runs every test file
// with Node's test runner, on runc; the machine suites run a second time on gVisor (runsc) when it works here.

import { spawnSync } from "node:child_process";
import { ensureBaseTemplate } from "../src/builder/base-template.ts";
import { createLogger } from "../src/log.ts";
import { TEST_CACHE_DIR } from "../test/support/paths.ts";

const started = Date.now();
const log = createLogger({ level: "warn", pretty: false });
const base = await ensureBaseTemplate({
  cacheDir: TEST_CACHE_DIR,
  log,
  onProgress: (line) => process.stderr.write(`[base ${((Date.now() - started) / 1000).toFixed(0)}s] ${line}\n`),
});
process.stderr.write(`base template ${base.created ? "made" : "cached"} at ${base.layerDir} (${((Date.now() - started) / 1000).toFixed(1)} s)\n`);

const files = process.argv.slice(2);
const run = spawnSync(
  process.execPath,
  ["--test", "--test-reporter=spec", "--test-concurrency=2", "--test-timeout=300000", ...(files.length ? files : ["test/**/*.test.ts"])],
  { stdio: "inherit", env: { ...process.env, KILN_TEST_CACHE_DIR: TEST_CACHE_DIR } },
);
process.exit(run.status ?? 1);
