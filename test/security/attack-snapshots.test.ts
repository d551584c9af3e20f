// Attacks on snapshots and forks (docs/snapshots.md), driven from outside through the API: a key holder pushing past
// the host's bounds with concurrent requests.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { createMachine, stopSnapshotKiln } from "../snapshots/support.ts";

const MAX = 2;
let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_MAX_SNAPSHOTS: String(MAX) } });
});
after(() => stopSnapshotKiln(k));

test("KILN_MAX_SNAPSHOTS holds against concurrent snapshot requests, on one machine and on several", async () => {
  const a = await createMachine(k);
  const b = await createMachine(k);
  // Each request is checked against the cap before it waits for its machine: all of them at once.
  const shots = await Promise.all([a, a, a, b, b, b].map((m) => k.call("POST", `/v1/machines/${m.id}/snapshots`, { body: {} })));
  const made = shots.filter((r) => r.status === 201);
  const refused = shots.filter((r) => r.status === 409);
  assert.equal(made.length, MAX, `made ${made.length} snapshots past a cap of ${MAX}: ${shots.map((r) => r.status).join(",")}`);
  assert.equal(refused.length, shots.length - MAX);
  for (const r of refused) assert.match(r.body.error, /at most 2 snapshots/);
  const listed = await k.call("GET", "/v1/snapshots?limit=100");
  assert.equal(listed.body.snapshots.length, MAX);
  // A fork takes a snapshot too: refused at the cap, whatever its count.
  const fork = await k.call("POST", `/v1/machines/${a.id}/fork`, { body: { count: 1 } });
  assert.equal(fork.status, 409, fork.text);
  for (const m of [a, b]) await k.call("DELETE", `/v1/machines/${m.id}`);
});
