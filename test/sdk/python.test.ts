// The Python SDK's own tests (sdk/python/tests, unittest) run by Debian's /usr/bin/python3 against a real server.

import { after, before, it } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { join } from "node:path";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

const SDK_DIR = join(import.meta.dirname, "..", "..", "sdk", "python");
const PYTHON = "/usr/bin/python3";

let k: TestKiln;
before(async () => {
  // The SDK's webhook test runs its receiver on loopback and lets its webhook reach it (allow_private, operator key).
  k = await startTestKiln();
});
after(async () => {
  await k?.close();
});

it("the Python SDK passes its tests against a real server", async () => {
  const child = spawn(PYTHON, ["-m", "unittest", "discover", "-s", "tests", "-v"], {
    cwd: SDK_DIR,
    // Only what the SDK reads: no pyenv or site packages of the host leak in.
    env: { PATH: "/usr/bin:/bin", KILN_URL: k.url, KILN_API_KEY: TEST_KEY, PYTHONDONTWRITEBYTECODE: "1", PYTHONNOUSERSITE: "1" },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let output = "";
  child.stdout.on("data", (b: Buffer) => (output += b));
  child.stderr.on("data", (b: Buffer) => (output += b));
  const code = await new Promise<number | null>((resolve) => child.on("close", resolve));
  assert.equal(code, 0, output);
  assert.match(output, /Ran [7-9] tests/);
  assert.match(output, /\nOK\n/);
});
