// GET /v1/ready's report is shared by probes that arrive together (src/api/coalesce.ts), but never older than the
// probe: a caller always gets a run begun after it asked.

import { test } from "node:test";
import assert from "node:assert/strict";
import { coalesce } from "../../src/api/coalesce.ts";

test("callers that arrive while a report is being made share the next one, begun after they asked", async () => {
  let runs = 0;
  let release: (() => void) | undefined;
  const report = coalesce(async () => {
    const n = ++runs;
    await new Promise<void>((resolve) => (release = resolve));
    return n;
  });
  const first = report();
  // The run begins once the loop has read the I/O already waiting (the callers of one turn share it).
  await new Promise((r) => setImmediate(r));
  assert.equal(runs, 1);
  // Arrive while the first run is in flight: they must not get its (older) answer.
  const late = [report(), report(), report()];
  release!();
  assert.equal(await first, 1);
  await new Promise((r) => setImmediate(r));
  assert.equal(runs, 2, "one run for all three late callers");
  release!();
  assert.deepEqual(await Promise.all(late), [2, 2, 2]);
});

test("callers of one turn of the event loop share one run, begun after all of them asked", async () => {
  let runs = 0;
  const report = coalesce(async () => ++runs);
  const together = [report(), report(), report()];
  assert.equal(runs, 0, "no run begins while the turn's callers are still arriving");
  assert.deepEqual(await Promise.all(together), [1, 1, 1]);
  assert.equal(await report(), 2, "a caller after that run gets a new one");
});

test("a caller after a run has settled gets a new run; a failed run is not shared with later callers", async () => {
  let runs = 0;
  const report = coalesce(async () => {
    runs++;
    if (runs === 1) throw new Error("store down");
    return runs;
  });
  await assert.rejects(report(), /store down/);
  assert.equal(await report(), 2);
  assert.equal(await report(), 3);
});

test("under a steady stream, runs begin at least minIntervalMs apart and every caller still gets a fresh one", async () => {
  const started: number[] = [];
  const report = coalesce(async () => {
    started.push(performance.now());
    return started.length;
  }, 20);
  const asked: { at: number; got: Promise<number> }[] = [];
  for (let i = 0; i < 10; i++) {
    asked.push({ at: performance.now(), got: report() });
    await new Promise((r) => setTimeout(r, 5));
  }
  for (const a of asked) {
    const n = await a.got;
    assert.ok(started[n - 1]! >= a.at, "the run a caller got began after it asked");
  }
  // Timers fire on the loop's millisecond clock, up to ~1 ms before performance.now() says they are due.
  for (let i = 1; i < started.length; i++) assert.ok(started[i]! - started[i - 1]! >= 18, `runs ${i} and ${i + 1} began ${started[i]! - started[i - 1]!} ms apart`);
  assert.ok(started.length < 10, `${started.length} runs for 10 callers`);
});
