// Agent deployments through the API and the public edge: a real HTTP service reaches ready, its public URL proxies
// HTTP (a 50 MB streamed download too) and WebSocket, tokens are checked, restarts carry request-only envs that are
// stored nowhere, crashes end failed, and a rolling update keeps some replica answering throughout.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { readFileSync, readdirSync, statSync } from "node:fs";
import { join } from "node:path";
import { request } from "undici";
import { WebSocket } from "ws";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { appCommand, createDeployment, services, waitService } from "./support.ts";
import { loadEdgeSecret, signEdgeToken } from "../../src/deployments/edge-tokens.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_SERVICE_MAX_CRASHES: "3", KILN_SERVICE_BACKOFF_MS: "50" } });
});
after(async () => {
  if (!k) return;
  const res = await k.call("GET", "/v1/agent-deployments");
  for (const d of res.body?.deployments ?? []) await k.call("DELETE", `/v1/agent-deployments/${d.id}`);
  await k.close();
});

const fast = { interval_s: 0.2, timeout_s: 1 };

/** Every file under a directory, for greps of the whole data dir (the SQLite store included). */
function allFiles(dir: string): string[] {
  const out: string[] = [];
  for (const name of readdirSync(dir)) {
    const p = join(dir, name);
    let st;
    try {
      st = statSync(p);
    } catch {
      continue;
    }
    if (st.isDirectory()) {
      if (name === "machines" || name === "cache") continue; // machine root filesystems, the base template
      out.push(...allFiles(p));
    } else out.push(p);
  }
  return out;
}

function dataDirContains(marker: string): string[] {
  return allFiles(k.dataDir).filter((f) => readFileSync(f).includes(marker));
}

test("a python3 -m http.server deployment reaches ready; public_url is null while it starts", async () => {
  const dep = await createDeployment(k, { name: "static", command: "python3 -m http.server 8000", port: 8000, readiness: fast });
  assert.match(dep.id, /^dep_/);
  assert.equal(dep.versions.length, 1);
  const [svc] = await services(k, dep.id);
  assert.match(svc.id, /^svc_/);
  assert.equal(svc.status, "starting");
  assert.equal(svc.public_url, null);
  assert.match(svc.machine_id, /^mch_/);
  assert.equal(typeof svc.process_id, "number");
  const ready = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
  assert.match(ready.public_url, /\/edge\/svc_[^/]+\/\?edge_token=/);
  assert.equal(ready.readiness_status.probe, "tcp");
  assert.ok(ready.readiness_status.attempts >= 1);
  const res = await request(ready.public_url);
  assert.equal(res.statusCode, 200);
  assert.match(await res.body.text(), /Directory listing/);
});
