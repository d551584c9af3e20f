// Template builds on PostgreSQL: records, the durable log, the layer cache and history paging work on both stores.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startPostgres } from "../support/postgres.ts";
import type { TestPostgres } from "../support/postgres.ts";
import { build, buildOk, machineFrom, parseSse, sh } from "./support.ts";

let pg: TestPostgres;
let k: TestKiln;
before(async () => {
  pg = await startPostgres();
  k = await startTestKiln({ env: { KILN_DATABASE_URL: pg.url, KILN_WARM_POOL: "0" } });
});
after(async () => {
  await k?.close();
  await pg?.stop();
});

test("on PostgreSQL: build, cached rebuild, failed attempt, history pages and log replay", async () => {
  const steps = [{ type: "run", command: "echo pg > /pg" }, { type: "env", envs: { STORE: "postgres" } }];
  const first = await buildOk(k, { name: "on-pg", steps });
  const again = await buildOk(k, { name: "on-pg", steps });
  assert.equal(again.artifactId, first.artifactId);
  const failed = await build(k, { name: "on-pg", steps: [{ type: "run", command: "exit 2" }] });
  assert.equal(failed.events.at(-1)!.data.error_detail.code, "build_error");
  const m = await machineFrom(k, "on-pg");
  assert.equal((await sh(k, m, "cat /pg; echo $STORE")).stdout, "pg\npostgres\n");
  const p1 = await k.call("GET", "/v1/templates/on-pg/builds?limit=2");
  assert.equal(p1.status, 200, p1.text);
  assert.equal(p1.body.builds[0].status, "error");
  assert.equal(typeof p1.body.builds[0].duration_ms, "number");
  const p2 = await k.call("GET", `/v1/templates/on-pg/builds?limit=2&cursor=${encodeURIComponent(p1.body.next_cursor)}`);
  assert.deepEqual(p2.body.builds.map((b: { build_id: string }) => b.build_id), [first.buildId]);
  assert.equal(p2.body.next_cursor, null);
  assert.equal(p1.body.builds[1].cache_summary.final_artifact_hits, 1);
  const res = await request(`${k.url}/v1/templates/on-pg/builds/${first.buildId}/logs`, { headers: { authorization: `Bearer ${TEST_KEY}`, "last-event-id": "2" } });
  const replay = parseSse(await res.body.text());
  assert.equal(replay[0].id, 3);
  assert.equal(replay.at(-1)!.event, "end");
});
