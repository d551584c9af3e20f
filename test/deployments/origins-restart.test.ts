// Turning KILN_EDGE_DOMAIN on for a server that already has deployments: a start without it warns (their pages
// share the API's origin, sandboxed); the next start with it gives the same deployment its own origin, same token.

import { test } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { appCommand, createDeployment, services, waitService } from "./support.ts";

const WARNING = /deployments' pages share the API's origin/;

test("a start without KILN_EDGE_DOMAIN warns about existing deployments; a start with it moves their URLs to their own origin, same token", async () => {
  let k: TestKiln = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  const dataDir = k.dataDir;
  try {
    assert.ok(!k.logs.some((l) => WARNING.test(l)), "no deployments yet: no warning");
    const dep = await createDeployment(k, { name: "origins-restart", command: appCommand(8080), port: 8080, readiness: { path: "/health", interval_s: 0.2, timeout_s: 1 } });
    const [svc] = await services(k, dep.id);
    await waitService(k, dep.id, svc.id, (s) => s.status === "ready", 120_000);
    const token = new URL(dep.edge_url).searchParams.get("edge_token");
    assert.match(dep.edge_url, new RegExp(`/edge/${dep.id}/\\?edge_token=kse_`));
    await k.stop();

    k = await startTestKiln({ dataDir, env: { KILN_WARM_POOL: "0" } });
    const line = k.logs.find((l) => WARNING.test(l));
    assert.ok(line, "the start warns");
    assert.equal(JSON.parse(line).level, 40);
    assert.equal(JSON.parse(line).deployments, 1);
    await k.stop();

    k = await startTestKiln({ dataDir, env: { KILN_WARM_POOL: "0", KILN_EDGE_DOMAIN: "localhost" } });
    assert.ok(!k.logs.some((l) => WARNING.test(l)), "with an edge domain: no warning");
    const now = (await k.call("GET", `/v1/agent-deployments/${dep.id}`)).body;
    const port = new URL(k.url).port;
    assert.equal(now.edge_url, `http://${dep.id.replace("_", "")}.localhost:${port}/?edge_token=${token}`);
    await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
    const res = await request(`${k.url}/hello${new URL(now.edge_url).search}`, { headers: { host: new URL(now.edge_url).host } });
    assert.equal(res.statusCode, 200);
    assert.match(await res.body.text(), /^hello from \/hello/);
    // The path form still answers old links, sandboxed.
    const old = await request(`${k.url}/edge/${dep.id}/hello?edge_token=${token}`);
    assert.equal(old.statusCode, 200);
    assert.match(String(old.headers["content-security-policy"]), /^sandbox /);
    await old.body.text();
    await k.call("DELETE", `/v1/agent-deployments/${dep.id}`);
  } finally {
    // A failure between a stop and the next start: start once more, so close() destroys the machine it left.
    if ((await k.call("GET", "/health").catch(() => undefined)) === undefined) k = await startTestKiln({ dataDir, env: { KILN_WARM_POOL: "0" } });
    await k.close();
  }
});
