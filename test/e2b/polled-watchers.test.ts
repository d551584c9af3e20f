// envd's polled watchers (CreateWatcher …) held by the E2B layer, in-process over a stand-in for the machine's
// watches: a sandbox holds at most MAX_POLLED_PER_MACHINE of them, ended ones included, and ended ones give way to new
// ones — a pause/resume cycle (every watch ends) repeated forever no longer piles up watchers in the server.

import { test } from "node:test";
import assert from "node:assert/strict";
import { createPolledWatchers, MAX_POLLED_PER_MACHINE } from "../../src/compat/e2b/watch.ts";
import type { ProcessRegistry, WatchListener } from "../../src/compat/e2b/processes.ts";

function standIn() {
  const live = new Map<string, WatchListener[]>();
  const processes = {
    async watch(machineId: string, _path: string, _recursive: boolean, listener: WatchListener) {
      live.set(machineId, [...(live.get(machineId) ?? []), listener]);
      return () => live.set(machineId, (live.get(machineId) ?? []).filter((l) => l !== listener));
    },
  } as unknown as ProcessRegistry;
  /** The machine's socket closed (a pause, a destroy): every watch of it ends. */
  const endAll = (machineId: string) => {
    for (const l of live.get(machineId) ?? []) l({ type: "end", error: "the sandbox was paused" });
    live.delete(machineId);
  };
  return { processes, endAll };
}

test("a sandbox holds at most the bound of polled watchers; the next is resource_exhausted, another sandbox is not affected", async () => {
  const { processes } = standIn();
  const polled = createPolledWatchers(processes);
  const ids: string[] = [];
  for (let i = 0; i < MAX_POLLED_PER_MACHINE; i++) ids.push(await polled.create("mch_a", "/tmp", false));
  await assert.rejects(polled.create("mch_a", "/tmp", false), (err: { code?: string }) => err.code === "resource_exhausted");
  await polled.create("mch_b", "/tmp", false);
  polled.remove("mch_a", ids[0]);
  await polled.create("mch_a", "/tmp", false);
});

test("ended watchers give way: pause/resume cycles keep a sandbox at the bound, and an ended one still tells its next poll", async () => {
  const { processes, endAll } = standIn();
  const polled = createPolledWatchers(processes);
  const cycles: string[][] = [];
  for (let cycle = 0; cycle < 5; cycle++) {
    const ids: string[] = [];
    for (let i = 0; i < MAX_POLLED_PER_MACHINE; i++) ids.push(await polled.create("mch_a", "/tmp", false));
    cycles.push(ids);
    endAll("mch_a");
  }
  const last = cycles.at(-1)!;
  // An earlier cycle's ended watchers were displaced by the next cycle's: nothing of them is held.
  for (const id of cycles[0]) await assert.rejects(polled.take("mch_a", id), /not found/);
  // The last cycle's watchers are ended but not yet displaced: a poll hears why, once; then the watcher is gone.
  await assert.rejects(polled.take("mch_a", last[0]), /ended: the sandbox was paused/);
  await assert.rejects(polled.take("mch_a", last[0]), /not found/);
});
