// A control-plane restart re-attaches to running services: the process keeps running (same pid), the record stays
// ready, the public URL keeps working with the same edge secret, and supervision carries on.

import { test } from "node:test";
import assert from "node:assert/strict";
import { statSync } from "node:fs";
import { join } from "node:path";
import { request } from "undici";
import { startTestKiln } from "../support/kiln.ts";
import { appCommand, createDeployment, services, waitService } from "./support.ts";

test("the server restarted while a service runs keeps the service (same pid), and its public URL still answers", async () => {
  const env = { KILN_SERVICE_MAX_CRASHES: "3", KILN_SERVICE_BACKOFF_MS: "50" };
  const first = await startTestKiln({ env });
  let second: Awaited<ReturnType<typeof startTestKiln>> | undefined;
  try {
    const dep = await createDeployment(first, { name: "survivor", command: appCommand(8090), port: 8090, readiness: { interval_s: 0.2, timeout_s: 1, path: "/health" } });
    const [svc] = await services(first, dep.id);
    const ready = await waitService(first, dep.id, svc.id, (s) => s.status === "ready");
    const pidUrl = ready.public_url.replace("/?", "/pid?");
    const pidBefore = await (await request(pidUrl)).body.text();
    assert.equal((statSync(join(first.dataDir, "edge-secret")).mode & 0o777).toString(8), "600");

    await first.stop();
    second = await startTestKiln({ dataDir: first.dataDir, env });
    const after = await waitService(second, dep.id, svc.id, (s) => s.status === "ready" && s.readiness_status.attempts >= 1);
    assert.equal(after.process_id, ready.process_id, "the same process, not a restarted one");
    assert.equal(after.readiness_status.starts, 1);
    // A URL issued before the restart still works: tokens are checked against the secret kept in the data dir.
    const pidAfter = await (await request(pidUrl.replace(first.url, second.url))).body.text();
    assert.equal(pidAfter, pidBefore);
    const ops = (await second.kiln.services.store.db.selectFrom("events").select("operation").where("machine_id", "=", svc.machine_id).orderBy("seq").execute()).map((e) => e.operation);
    assert.deepEqual(ops.filter((o) => o.startsWith("service.")), ["service.starting", "service.ready"], "no status change across the restart");

    // Supervision carries on: a crash is seen and the process comes back.
    await second.call("POST", `/v1/machines/${svc.machine_id}/exec`, { body: { cmd: `kill -9 ${ready.process_id}` } });
    const back = await waitService(second, dep.id, svc.id, (s) => s.status === "ready" && s.process_id !== ready.process_id);
    assert.equal(back.readiness_status.crashes, 1);
    await second.call("DELETE", `/v1/agent-deployments/${dep.id}`);
  } finally {
    if (second) await second.close();
    else await first.close();
  }
});
