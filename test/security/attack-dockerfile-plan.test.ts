// A Dockerfile author against the planner that runs a Dockerfile on a Kiln template on the native executor
// (docs/builds.md "Dockerfiles on a Kiln template"): a Dockerfile must mean there what it means to Docker, or an
// instruction Docker reads as part of a RUN's text (a USER, an ENV…) takes effect on Kiln, and the reverse.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { buildOk } from "../builds/support.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

test("a line continued by a backslash with spaces after it, or across a blank line, joins the next line as in Docker", { timeout: 300_000 }, async () => {
  // Docker: `RUN echo trailing-space USER nobody` and `RUN echo blank-line USER nobody` — no USER takes effect.
  const dockerfile = ["FROM local/base", "RUN echo trailing-space \\ \t", "USER nobody", "RUN echo blank-line \\", "", "USER nobody", 'RUN test "$(id -un)" = root'].join("\n");
  const r = await buildOk(k, { name: `df-cont-${randomBytes(3).toString("hex")}`, dockerfile });
  const steps = r.events.filter((e) => e.event === "message" && /^step \d+\/\d+: /.test(e.data.message)).map((e) => e.data.message as string);
  assert.ok(steps.length > 0, "the Dockerfile ran on Kiln's executor");
  assert.ok(!steps.some((m) => /: USER /.test(m)), steps.join("\n"));
});
