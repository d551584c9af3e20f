// The guest agent's file watches (src/agent/watch.ts) in-process, on a host directory: events handled after later
// ones already happened (synchronous fs calls keep the event loop from seeing any in between) still say what each was.

import { test, after } from "node:test";
import assert from "node:assert/strict";
import { chmodSync, mkdtempSync, rmSync, writeFileSync, appendFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createWatches } from "../../src/agent/watch.ts";
import type { StreamServerFrame } from "../../src/agent/protocol.ts";

const dir = mkdtempSync(join(tmpdir(), "kiln-watch-"));
after(() => rmSync(dir, { recursive: true, force: true }));

function watching(path: string) {
  const events: { event: string; path: string }[] = [];
  let wake = () => {};
  const watches = createWatches({
    send: (f: StreamServerFrame) => {
      if (f.type === "file_event") events.push({ event: f.event, path: f.path });
      wake();
    },
    backlog: () => 0,
  });
  watches.start({ path, recursive: true });
  return {
    events,
    /** Resolves once an event of `file` with kind `event` came (at or after index `from`); rejects after 5 s. */
    async until(event: string, file: string, from = 0) {
      const deadline = Date.now() + 5000;
      while (!events.slice(from).some((e) => e.event === event && e.path === file)) {
        if (Date.now() > deadline) throw new Error(`no ${event} of ${file}; got ${JSON.stringify(events)}`);
        await new Promise<void>((r) => ((wake = r), setTimeout(r, 100)));
      }
    },
    close: () => watches.closeAll(),
  };
}

/** Blocks the event loop past the filesystem's timestamp granularity (a coarse clock tick), so ctime can move. */
const nextTick = () => Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 20);

test("a create, write and chmod handled after all three happened still report the chmod", async () => {
  const w = watching(dir);
  const file = join(dir, "late.txt");
  writeFileSync(file, "deep\n");
  nextTick();
  chmodSync(file, 0o600);
  await w.until("create", file);
  await w.until("chmod", file);
  w.close();
});

test("a write alone is a write, a chmod alone a chmod, a write then a chmod seen late are both", async () => {
  const file = join(dir, "steps.txt");
  writeFileSync(file, "a");
  await new Promise((r) => setTimeout(r, 0)); // the loop reads that create before the watch starts
  const w = watching(dir);
  appendFileSync(file, "b");
  await w.until("write", file);
  assert.ok(!w.events.some((e) => e.event === "chmod"), JSON.stringify(w.events));
  chmodSync(file, 0o640);
  await w.until("chmod", file);
  const seen = w.events.length;
  appendFileSync(file, "c");
  nextTick();
  chmodSync(file, 0o600);
  await w.until("chmod", file, seen);
  const later = w.events.slice(seen);
  assert.ok(later.some((e) => e.event === "write"), JSON.stringify(later));
  assert.ok(later.some((e) => e.event === "chmod"), JSON.stringify(later));
  w.close();
});
