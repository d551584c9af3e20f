import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { buildOk, machineFrom, sh } from "./support.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

test("smoke", async () => {
  const t0 = Date.now();
  const r = await buildOk(k, { name: "smoke", steps: [{ type: "run", command: "echo hello; echo hi > /hello.txt" }, { type: "env", envs: { A: "b" } }, { type: "workdir", path: "/app" }] });
  console.log(Date.now() - t0, r.events.map((e) => `${e.id} ${e.event} ${e.data.message}`).join("\n"));
  const m = await machineFrom(k, "smoke");
  const out = await sh(k, m, "cat /hello.txt; echo $A; pwd");
  assert.equal(out.stdout, "hi\nb\n/app\n");
});
