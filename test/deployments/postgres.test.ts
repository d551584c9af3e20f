// Agent deployments over PostgreSQL: the same lifecycle (ready, restart with request-only envs, an idempotent
// repeat, delete), and no table of the database ever holds the restart envs or an edge token; the edge polls the
// store for other hosts' work only once another server shares it. The server is given a shared envs key file
// (KILN_DEPLOYMENT_ENVS_KEY_FILE): what it sealed opens with that file from another data dir.

import { test } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { randomBytes } from "node:crypto";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { loadEnvSealer } from "../../src/deployments/sealed-envs.ts";
import { sql } from "kysely";
import { startTestKiln } from "../support/kiln.ts";
import { startPostgres } from "../support/postgres.ts";
import { appCommand, createDeployment, services, waitService } from "./support.ts";

test("deployments on PostgreSQL: ready, restart envs reach the process and no table holds them, idempotent repeat, delete", async () => {
  const pg = await startPostgres();
  const keyDir = await mkdtemp(join(tmpdir(), "kiln-shared-key-"));
  const keyFile = join(keyDir, "envs.key");
  await writeFile(keyFile, randomBytes(32).toString("hex"), { mode: 0o600 });
  const k = await startTestKiln({ env: { KILN_DATABASE_URL: pg.url, KILN_HOST_HEARTBEAT_MS: "200", KILN_DEPLOYMENT_ENVS_KEY_FILE: keyFile } });
  let peer: Awaited<ReturnType<typeof startTestKiln>> | undefined;
  try {
    // Alone on its store the edge has no one else's writes or replicas to poll for; a second server makes it poll.
    assert.equal(k.kiln.services.deployments.edgePolls(), false, "a server alone on its store does not poll");
    peer = await startTestKiln({ env: { KILN_DATABASE_URL: pg.url, KILN_WARM_POOL: "0" }, captureLogs: false });
    const deadline = Date.now() + 10_000;
    while (!k.kiln.services.deployments.edgePolls()) {
      assert.ok(Date.now() < deadline, "the first server saw its peer at a heartbeat");
      await new Promise((r) => setTimeout(r, 50));
    }
    await peer.close();
    peer = undefined;

    const dep = await createDeployment(k, { name: "pg", command: appCommand(8085), port: 8085, envs: { DEP_ENV: "dep-env-value" }, readiness: { interval_s: 0.2, timeout_s: 1, path: "/health" } });
    // Sealed under the shared key: another server's data dir with the same file opens it; without the file, not.
    const sealed = (await sql<{ envs_sealed: string }>`select envs_sealed from deployment_versions where deployment_id = ${dep.id}`.execute(k.kiln.services.store.db)).rows[0].envs_sealed;
    assert.deepEqual((await loadEnvSealer(join(keyDir, "other"), keyFile)).open(sealed), { DEP_ENV: "dep-env-value" });
    const alone = await loadEnvSealer(join(keyDir, "alone"));
    assert.throws(() => alone.open(sealed));
    const [svc] = await services(k, dep.id);
    await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
    const marker = `pg-marker-${Date.now()}`;
    const path = `/v1/agent-deployments/${dep.id}/services/${svc.id}/restart`;
    const first = await k.call("POST", path, { body: { reason: "pg", envs: { PG_MARKER: marker } }, headers: { "idempotency-key": "pg-1" } });
    assert.equal(first.status, 200, first.text);
    const ready = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
    const base = ready.public_url.split("?")[0];
    const token = new URL(ready.public_url).searchParams.get("edge_token")!;
    assert.equal(await (await request(`${base}env/PG_MARKER?edge_token=${token}`)).body.text(), marker);
    const again = await k.call("POST", path, { body: { reason: "pg" }, headers: { "idempotency-key": "pg-1" } });
    assert.equal(again.body.process_id, first.body.process_id);

    const db = k.kiln.services.store.db;
    for (const table of ["deployments", "deployment_versions", "services", "service_restarts", "events", "machines"]) {
      const rows = await sql<Record<string, unknown>>`select * from ${sql.table(table)}`.execute(db);
      const text = JSON.stringify(rows.rows);
      assert.ok(!text.includes(marker), `${table} holds the restart envs`);
      assert.ok(!text.includes(token), `${table} holds an edge token`);
    }
    assert.ok(!k.logs.join("").includes(marker));

    const del = await k.call("DELETE", `/v1/agent-deployments/${dep.id}`);
    assert.equal(del.body.status, "deleted");
    assert.equal((await services(k, dep.id))[0].status, "stopped");
  } finally {
    await peer?.close();
    await k.close();
    await pg.stop();
    await rm(keyDir, { recursive: true, force: true });
  }
});
