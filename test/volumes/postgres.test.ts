// Volumes on a PostgreSQL store: records, pages, the mounts a machine holds (409 while it lives) and their cleanup.

import { test } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import { startPostgres } from "../support/postgres.ts";

test("volumes on PostgreSQL: create, page, mount in a machine, 409 while it lives, delete after", async () => {
  const pg = await startPostgres();
  const k = await startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_DATABASE_URL: pg.url } });
  try {
    assert.equal(k.kiln.services.store.dialect, "postgres");
    const ids: string[] = [];
    for (const name of ["a", "b", "c"]) ids.push((await k.call("POST", "/v1/volumes", { body: { name, size_mb: 16 } })).body.id);
    const first = await k.call("GET", "/v1/volumes?limit=2");
    assert.deepEqual(first.body.volumes.map((v: any) => v.id), [ids[2], ids[1]]);
    const second = await k.call("GET", `/v1/volumes?limit=2&cursor=${first.body.next_cursor}`);
    assert.deepEqual(second.body.volumes.map((v: any) => v.id), [ids[0]]);
    const m = (await k.call("POST", "/v1/machines", { body: { volumes: [{ volume_id: ids[0], path: "/data", read_only: true }] } })).body;
    assert.equal(m.status, "running");
    const busy = await k.call("DELETE", `/v1/volumes/${ids[0]}`);
    assert.equal(busy.status, 409);
    assert.deepEqual(busy.body.error_detail.details.machine_ids, [m.id]);
    await k.call("DELETE", `/v1/machines/${m.id}`);
    for (const id of ids) assert.equal((await k.call("DELETE", `/v1/volumes/${id}`)).status, 204);
    assert.deepEqual((await k.call("GET", "/v1/volumes")).body.volumes, []);
  } finally {
    await k.close();
    await pg.stop();
  }
});
