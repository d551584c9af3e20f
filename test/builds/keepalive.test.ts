// The build stream sends a `: keepalive` comment every 15 s while nothing else is said, so idle proxies and clients
// keep it open through a long step.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { build } from "./support.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

test("a `: keepalive` comment arrives every 15 s during a quiet step", async () => {
  const r = await build(k, { name: "quiet", steps: [{ type: "run", command: "sleep 16; echo awake" }] });
  assert.match(r.raw, /\n: keepalive\n\n/);
  assert.equal(r.events.at(-1)!.event, "end");
  assert.ok(r.raw.indexOf(": keepalive") < r.raw.indexOf('"awake"'), "the comment came while the step was quiet");
});
