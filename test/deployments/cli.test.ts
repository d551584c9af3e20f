// `kiln deployments …` as a person runs it against a real server: create, ls, services, logs, restart, rm.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { join } from "node:path";
import { promisify } from "node:util";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { waitService } from "./support.ts";

const run = promisify(execFile);
const KILN = join(import.meta.dirname, "..", "..", "bin", "kiln");

let k: TestKiln;
before(async () => {
  k = await startTestKiln();
});
after(async () => k?.close());

const cli = (args: string[], env: Record<string, string> = {}) => run(KILN, args, { env: { ...process.env, KILN_URL: k.url, KILN_API_KEY: TEST_KEY, ...env } });

test("kiln deployments create, ls, services, logs, restart and rm drive a real service", async () => {
  const { stdout } = await cli(["deployments", "create", "--name", "cli", "-c", "echo serving; python3 -m http.server 8000", "-p", "8000", "--readiness-interval", "0.2"]);
  const dep = stdout.trim();
  assert.match(dep, /^dep_/);
  assert.match((await cli(["deployments", "ls"])).stdout, new RegExp(`^${dep}\\tcli\\tv1\\t1 replica\\(s\\)\\tactive`, "m"));
  const line = (await cli(["deployments", "services", dep])).stdout.trim();
  const svc = line.split("\t")[0];
  assert.match(svc, /^svc_/);
  await waitService(k, dep, svc, (s) => s.status === "ready");
  const listed = (await cli(["deployments", "services", dep])).stdout;
  assert.doesNotMatch(listed, /edge_token/, "public URLs only when asked");
  assert.match((await cli(["deployments", "services", dep, "--urls"])).stdout, /edge_token=/);
  assert.match((await cli(["deployments", "logs", dep, svc])).stdout, /serving/);
  const restarted = await cli(["deployments", "restart", dep, svc, "--reason", "cli", "-e", "FROM_ENV", "--idempotency-key", "k1"], { FROM_ENV: "x" });
  assert.match(restarted.stdout, new RegExp(`^${svc} starting pid \\d+`));
  const again = await cli(["deployments", "restart", dep, svc, "--idempotency-key", "k1"]);
  assert.equal(again.stdout, restarted.stdout);
  assert.match((await cli(["deployments", "rm", dep])).stdout, /deleted/);
  await assert.rejects(cli(["deployments", "get", "dep_nope"]), (err: { stderr?: string }) => /not_found/.test(err.stderr ?? ""));
});
