// `kiln volumes` as a person runs it against a running server: create, ls, watch printing events live, rm.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFile, spawn } from "node:child_process";
import { join } from "node:path";
import { promisify } from "node:util";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

const run = promisify(execFile);
const KILN = join(import.meta.dirname, "..", "..", "bin", "kiln");

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

const env = () => ({ ...process.env, KILN_URL: k.url, KILN_API_KEY: TEST_KEY });
const cli = (args: string[]) => run(KILN, args, { env: env() });

test("kiln volumes create, ls, watch and rm drive a real volume; kiln machines create --volume mounts it", async () => {
  const id = (await cli(["volumes", "create", "datasets", "--size-mb", "32"])).stdout.trim();
  assert.match(id, /^vol_/);
  assert.match((await cli(["volumes", "ls"])).stdout, new RegExp(`${id}\\tdatasets\\t32 MiB`));

  const watcher = spawn(KILN, ["volumes", "watch", id, "/"], { env: env() });
  let out = "";
  let err = "";
  watcher.stdout.on("data", (d) => (out += d));
  const started = new Promise<void>((resolve) =>
    watcher.stderr.on("data", (d) => {
      err += d;
      if (err.includes("watching /")) resolve();
    }),
  );
  await started;
  await k.call("POST", `/v1/volumes/${id}/files/mkdir`, { body: { path: "/train/shards" } });
  await k.call("PUT", `/v1/volumes/${id}/files?path=/train/shards/0.bin`, { raw: "bytes", headers: { "content-type": "application/octet-stream" } });
  await new Promise<void>((resolve) => {
    const check = () => (/create +\/train\/shards\/0\.bin\n/.test(out) ? resolve() : setTimeout(check, 20));
    check();
  });
  assert.match(out, /create +\/train\/\n/);
  // A machine made by the CLI with the volume mounted read-only at /data, and one read-write at /shared.
  const ro = (await cli(["machines", "create", "--volume", `${id}:/data:ro`])).stdout.trim();
  const rw = (await cli(["machines", "create", "-v", `${id}:/shared`])).stdout.trim();
  assert.equal((await cli(["machines", "exec", ro, "cat /data/train/shards/0.bin"])).stdout, "bytes");
  await assert.rejects(cli(["machines", "exec", ro, "touch /data/nope"]));
  await cli(["machines", "exec", rw, "echo hi > /shared/from-machine"]);
  await new Promise<void>((resolve) => {
    const check = () => (/create +\/from-machine\n/.test(out) ? resolve() : setTimeout(check, 20));
    check();
  });
  await assert.rejects(cli(["machines", "create", "--volume", "nonsense"]), (e: { stderr?: string }) => /vol_id:\/path/.test(e.stderr ?? ""));
  await cli(["machines", "rm", ro, rw]);
  const exited = new Promise<number | null>((resolve) => watcher.once("exit", (code) => resolve(code)));
  watcher.kill("SIGINT");
  assert.equal(await exited, 0);

  await assert.rejects(cli(["volumes", "watch", "vol_00000000000000000000000000", "/"]), (e: { stderr?: string }) => /not_found/.test(e.stderr ?? ""));
  assert.match((await cli(["volumes", "rm", id])).stdout, /deleted/);
  assert.doesNotMatch((await cli(["volumes", "ls"])).stdout, new RegExp(id));
});
