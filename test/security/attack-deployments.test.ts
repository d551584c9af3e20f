// A service against the control plane (second round of issue 18's inside parties): what a deployment's own process
// does to its readiness probe must not cost the server anything that outlives the probe. Runs on runc and gVisor.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readdirSync, readlinkSync } from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

/** The server runs in this process: its open sockets are ours. */
function openSockets(): number {
  let n = 0;
  for (const fd of readdirSync("/proc/self/fd")) {
    try {
      if (readlinkSync(`/proc/self/fd/${fd}`).startsWith("socket:")) n++;
    } catch {
      // closed while we looked
    }
  }
  return n;
}

// Accepts one connection at a time, slowly, and keeps every one: the probe's connections complete after its
// deadline, one after the other, for as long as the service runs.
const SLOW_ACCEPT = String.raw`
import socket, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8000))
s.listen(0)
kept = []
while True:
    c, _ = s.accept()
    kept.append(c)
    time.sleep(0.4)
`;

test("a service that accepts its readiness probes after their timeout leaves the server no open connection per probe", async () => {
  const before = openSockets();
  const res = await k.call("POST", "/v1/agent-deployments", {
    body: { name: "slow-accept", template: "local/base", command: `python3 -c '${SLOW_ACCEPT.replaceAll("'", "'\\''")}'`, port: 8000, readiness: { interval_s: 0.1, timeout_s: 0.1 } },
  });
  assert.equal(res.status, 201, res.text);
  const dep = res.body as { id: string };
  try {
    // Wait until the service runs and has been probed a good many times.
    const started = Date.now();
    let attempts = 0;
    while (Date.now() - started < 120_000) {
      const s = await k.call("GET", `/v1/agent-deployments/${dep.id}/services`);
      attempts = (s.body?.services?.[0]?.readiness_status?.attempts as number | undefined) ?? 0;
      if (attempts >= 120) break;
      await sleep(500);
    }
    assert.ok(attempts >= 120, `the service was probed ${attempts} times`);
    const grown = openSockets() - before;
    // Without the bound every late probe stays open on the server (≈ 3 a second here, > 60 by now); with it, only the
    // machine's own connections and at most a probe or two in flight remain.
    assert.ok(grown < 40, `the server holds ${grown} more sockets after ${attempts} probes`);
  } finally {
    await k.call("DELETE", `/v1/agent-deployments/${dep.id}`);
  }
});
