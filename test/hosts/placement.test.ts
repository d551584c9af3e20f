// Placement's order in-process, on a real SQLite store: accepting hosts first, then those holding the template's
// layers, then those with a warm machine ready for it (less the creates already on their way there), then load.

import { test, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { openStore } from "../../src/store/db.ts";
import { createPlacement } from "../../src/hosts/placement.ts";
import type { HostRow } from "../../src/store/schema.ts";
import type { HostCapacity } from "../../src/hosts/service.ts";

const dir = mkdtempSync(join(tmpdir(), "kiln-placement-"));
const store = await openStore({ dataDir: dir });
after(async () => {
  await store.close();
  rmSync(dir, { recursive: true, force: true });
});

function host(id: string, capacity: Partial<HostCapacity> = {}): HostRow {
  const now = new Date().toISOString();
  const c: HostCapacity = { cores: 2, memory_mb: 4096, mem_available_mb: 2048, min_free_memory_mb: 256, free_disk_mb: 10_000, min_free_disk_mb: 1024, max_disk_mb: 10_000, live_machines: 0, accepting: true, ...capacity };
  return { id, name: id, advertise_url: `http://${id}`, status: "active", capacity_json: JSON.stringify(c), heartbeat_at: now, started_at: now, created_at: now, updated_at: now, lost_at: null } as HostRow;
}

test("among hosts equally loaded, one with a warm machine ready for the template comes first; locality and load come before it", async () => {
  const rows = [host("h-a"), host("h-b", { warm_ready: { base: 1, art_hot: 0 } }), host("h-c", { warm_ready: { art_hot: 1 } })];
  const placement = createPlacement({ db: store.db, hostId: "h-self", lostAfterS: 30, hosts: async () => new Map(rows.map((h) => [h.id, h])) });
  // Equal loads: without the warm preference the order would be the random tiebreak's.
  for (let i = 0; i < 10; i++) {
    assert.equal((await placement.candidates(undefined, "base"))[0].id, "h-b");
    assert.equal((await placement.candidates(undefined, "art_hot"))[0].id, "h-c");
  }
  // Holding the layers outranks a warm machine (a host that lacks them would fetch them first).
  assert.equal((await placement.candidates(new Set(["h-a"]), "art_hot"))[0].id, "h-a");
  // A create on its way to h-b: more loaded, and its one warm machine is spoken for; a burst still spreads.
  const release = placement.hold("h-b");
  assert.notEqual((await placement.candidates(undefined, "base"))[0].id, "h-b");
  release();
});
