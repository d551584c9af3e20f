// The webhook settings and the host id: KILN_WEBHOOK_* parsing and refusals, and a host id that is stable per data
// dir, overridable by KILN_HOST_ID.

import { test } from "node:test";
import assert from "node:assert/strict";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { loadConfig, DEFAULT_WEBHOOK_RETRY_SCHEDULE_MS } from "../../src/config.ts";
import { ensureHostId } from "../../src/runtime/host-id.ts";

test("the retry schedule defaults to DESIGN.md's and KILN_WEBHOOK_RETRY_SCHEDULE_MS overrides it", () => {
  assert.deepEqual(loadConfig({}).webhookRetryScheduleMs, [0, 5_000, 300_000, 1_800_000, 7_200_000, 18_000_000, 36_000_000, 36_000_000]);
  assert.deepEqual(loadConfig({}).webhookRetryScheduleMs, DEFAULT_WEBHOOK_RETRY_SCHEDULE_MS);
  assert.deepEqual(loadConfig({ KILN_WEBHOOK_RETRY_SCHEDULE_MS: "0, 10,20" }).webhookRetryScheduleMs, [0, 10, 20]);
  for (const bad of ["5,10", "0,-1", "0,x", "0,,5", "0,1.5"]) {
    assert.throws(() => loadConfig({ KILN_WEBHOOK_RETRY_SCHEDULE_MS: bad }), /KILN_WEBHOOK_RETRY_SCHEDULE_MS/, bad);
  }
  assert.equal(loadConfig({}).webhookAllowPrivate, false);
  assert.equal(loadConfig({ KILN_WEBHOOK_ALLOW_PRIVATE: "1" }).webhookAllowPrivate, true);
  assert.equal(loadConfig({}).webhookRotationGraceMs, 24 * 3600_000);
  assert.throws(() => loadConfig({ KILN_HOST_ID: "has space" }), /KILN_HOST_ID/);
});

test("the host id is made once per data dir and KILN_HOST_ID overrides it", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-host-"));
  try {
    const first = await ensureHostId(dir);
    assert.match(first, /^host_[0-9a-f]{20}$/);
    assert.equal(await ensureHostId(dir), first, "stable across starts");
    assert.equal((await readFile(join(dir, "host-id"), "utf8")).trim(), first);
    assert.equal(await ensureHostId(dir, "rack-7"), "rack-7");
    const other = await mkdtemp(join(tmpdir(), "kiln-host-"));
    assert.notEqual(await ensureHostId(other), first, "another data dir is another host");
    await rm(other, { recursive: true, force: true });
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
