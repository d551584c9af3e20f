// Bounded listings (issue 18, item 23): a directory of 400k hard links (no extra disk) lists in pages — in a machine
// and in a volume — with the server's and the agent's memory bounded and /health answering meanwhile; small
// directories keep their one-answer shape; cursors are bound to their listing. Runs on runc: the walk is the
// same code under gVisor, where making 400k links through the gofer alone takes minutes.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import { request } from "undici";
import { monitorEventLoopDelay } from "node:perf_hooks";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { LIST_DEFAULT_LIMIT, LIST_MAX_LIMIT } from "../../src/agent/list-pages.ts";
import { encodeListCursor } from "../../src/store/cursor.ts";

const LINKS = 400_000;
const FILES = 8;

let k: TestKiln;
let m: { id: string };
let vol: { id: string };
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  const v = await k.call("POST", "/v1/volumes", { body: { name: "links", size_mb: 1024 } });
  assert.equal(v.status, 201, v.text);
  vol = v.body;
  const res = await k.call("POST", "/v1/machines", { body: { template: "local/base", internet: false, timeout_s: 3600, volumes: [{ volume_id: vol.id, path: "/vol" }] } });
  assert.equal(res.status, 201, res.text);
  m = res.body;
  // A few files and 400k hard links to them (ext4 allows 65,000 per file), in the machine's disk and in the volume:
  // directory entries, no data.
  const make = `import os, sys
for d in sys.argv[1:]:
    os.makedirs(d, exist_ok=True)
    for j in range(${FILES}):
        open("%s/f%d" % (d, j), "w").write("x")
    for i in range(${LINKS}):
        os.link("%s/f%d" % (d, i % ${FILES}), "%s/l%06d" % (d, i))
print("made")`;
  const r = await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "python3", args: ["-", "/tmp/links", "/vol/links"], stdin: make, user: "root", timeout_s: 280 } });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.body.stdout, "made\n", r.body.stderr);
});
after(async () => k?.close());

/**
 * While `fn` runs: the peak RSS growth of this process (the server runs in it), the slowest /health round trip, and
 * the server's event-loop delay (p99 and max: how long anything else waited behind the listing's own work).
 */
async function watchServer<T>(fn: () => Promise<T>): Promise<{ value: T; growthMb: number; slowestHealthMs: number; loopP99Ms: number; loopMaxMs: number }> {
  const base = process.memoryUsage().rss;
  let peak = base;
  let slowest = 0;
  let done = false;
  const loop = monitorEventLoopDelay({ resolution: 10 });
  loop.enable();
  const sampler = setInterval(() => (peak = Math.max(peak, process.memoryUsage().rss)), 20);
  // A real HTTP round trip every 100 ms.
  const pinger = (async () => {
    while (!done) {
      const t0 = performance.now();
      const res = await request(`${k.url}/health`);
      await res.body.text();
      slowest = Math.max(slowest, performance.now() - t0);
      await new Promise((r) => setTimeout(r, 100));
    }
  })();
  try {
    const value = await fn();
    return { value, growthMb: (peak - base) / 1024 / 1024, slowestHealthMs: slowest, loopP99Ms: loop.percentile(99) / 1e6, loopMaxMs: loop.max / 1e6 };
  } finally {
    done = true;
    loop.disable();
    clearInterval(sampler);
    await pinger;
  }
}

/** Generous, for a loaded 2-core host: what the issue saw was a 1.85 s stall of /health on an idle one. */
function assertResponsive(run: { slowestHealthMs: number; loopP99Ms: number; loopMaxMs: number }) {
  assert.ok(run.loopP99Ms < 250, `the server's event loop waited ${run.loopP99Ms.toFixed(0)} ms (p99)`);
  assert.ok(run.slowestHealthMs < 3000, `/health took up to ${run.slowestHealthMs.toFixed(0)} ms`);
}

/**
 * Reads `pages` pages of a listing from `cursor` (or its start), checking that names come in order across pages and
 * only the last page of the listing is short; returns what it saw and where it stopped.
 */
async function pageThrough(url: string, limit: number, pages: number, cursor: string | null = null) {
  let count = 0;
  let read = 0;
  let largestAnswer = 0;
  let last = "";
  do {
    const res = await k.call("GET", `${url}&limit=${limit}${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ""}`);
    assert.equal(res.status, 200, res.text.slice(0, 300));
    largestAnswer = Math.max(largestAnswer, res.text.length);
    const names = (res.body.entries as { name: string }[]).map((e) => e.name);
    assert.ok(names.length <= limit);
    for (const name of names) {
      assert.ok(name > last, `names in order across pages: ${JSON.stringify(last)} then ${JSON.stringify(name)}`);
      last = name;
    }
    count += names.length;
    read++;
    cursor = res.body.next_cursor;
    if (cursor) assert.equal(names.length, limit, "only the last page is short");
  } while (cursor && read < pages);
  return { count, largestAnswer, last, cursor };
}

/**
 * A whole pass over 400k names costs one scan of the directory per page (docs/security/machines.md), minutes on a
 * busy 2-core host: the first pages are read in turn, then the listing is picked up near its end with a cursor as
 * the server makes them (each page starting right after the last entry of the one before is what is checked).
 */
async function firstAndLastPages(url: string, listing: { path: string; depth: number }) {
  const head = await pageThrough(url, LIST_MAX_LIMIT, 3);
  assert.equal(head.count, 3 * LIST_MAX_LIMIT);
  assert.ok(head.cursor);
  assert.equal(head.last, `l${String(3 * LIST_MAX_LIMIT - FILES - 1).padStart(6, "0")}`, "f0…f7 first, then the links in order");
  const tail = await pageThrough(url, LIST_MAX_LIMIT, 3, encodeListCursor(listing, [`l${String(LINKS - 1500).padStart(6, "0")}`]));
  assert.equal(tail.count, 1499);
  assert.equal(tail.last, `l${String(LINKS - 1).padStart(6, "0")}`);
  assert.equal(tail.cursor, null, "the last page says so");
  return { largestAnswer: Math.max(head.largestAnswer, tail.largestAnswer) };
}

/** The agent's peak RSS so far (VmHWM), read from the host. */
function agentPeakMb(): number {
  const procs = `/sys/fs/cgroup/pids/kiln/${m.id}/cgroup.procs`;
  const pids = existsSync(procs) ? readFileSync(procs, "utf8").split("\n").filter(Boolean) : [];
  const agent = pids.find((pid) => {
    const cmd = readFileSync(`/proc/${pid}/cmdline`, "utf8");
    return cmd.includes("agent.cjs") && !cmd.includes("tini");
  });
  assert.ok(agent, "the agent's host pid");
  return Number(/^VmHWM:\s+(\d+) kB/m.exec(readFileSync(`/proc/${agent}/status`, "utf8"))![1]) / 1024;
}

test("a machine directory of 400k hard links lists in pages, in order; server and agent memory bounded; /health answers", async (t) => {
  const agentBefore = agentPeakMb();
  const run = await watchServer(() => firstAndLastPages(`/v1/machines/${m.id}/files/list?path=/tmp/links`, { path: "/tmp/links", depth: 1 }));
  assert.ok(run.value.largestAnswer < 8 * 1024 * 1024, `largest page ${run.value.largestAnswer} bytes`);
  // Before pages: one 104 MB answer and 650 MB more in the server.
  assert.ok(run.growthMb < 200, `the server grew ${run.growthMb.toFixed(0)} MB`);
  assertResponsive(run);
  const agentGrowth = agentPeakMb() - agentBefore;
  assert.ok(agentGrowth < 150, `the agent's peak RSS grew ${agentGrowth.toFixed(0)} MB`);
  t.diagnostic(`server RSS +${run.growthMb.toFixed(0)} MB, agent peak +${agentGrowth.toFixed(0)} MB, event loop p99 ${run.loopP99Ms.toFixed(0)} ms (max ${run.loopMaxMs.toFixed(0)}), slowest /health ${run.slowestHealthMs.toFixed(0)} ms, largest page ${run.value.largestAnswer} B`);
});

test("a volume directory of 400k hard links lists in pages with the server's memory bounded and /health answering", async (t) => {
  const run = await watchServer(() => firstAndLastPages(`/v1/volumes/${vol.id}/files/list?path=/links`, { path: "/links", depth: 1 }));
  assert.ok(run.growthMb < 200, `the server grew ${run.growthMb.toFixed(0)} MB`);
  assertResponsive(run);
  t.diagnostic(`server RSS +${run.growthMb.toFixed(0)} MB, event loop p99 ${run.loopP99Ms.toFixed(0)} ms (max ${run.loopMaxMs.toFixed(0)}), slowest /health ${run.slowestHealthMs.toFixed(0)} ms`);
});

test("without limit a page is at most the default; small directories keep their one answer (next_cursor null)", async () => {
  const big = await k.call("GET", `/v1/machines/${m.id}/files/list?path=/tmp/links`);
  assert.equal(big.status, 200);
  assert.equal(big.body.entries.length, LIST_DEFAULT_LIMIT);
  assert.equal(typeof big.body.next_cursor, "string");
  const small = await k.call("GET", `/v1/machines/${m.id}/files/list?path=/etc&depth=1`);
  assert.equal(small.status, 200);
  assert.ok(small.body.entries.length > 10 && small.body.entries.length < LIST_DEFAULT_LIMIT);
  assert.equal(small.body.next_cursor, null);
  for (const url of [`/v1/machines/${m.id}/files/list?path=/tmp/links&limit=${LIST_MAX_LIMIT + 1}`, `/v1/volumes/${vol.id}/files/list?path=/links&limit=0`]) {
    assert.equal((await k.call("GET", url)).status, 400, url);
  }
});

test("a depth listing pages through subdirectories in depth-first order; a cursor works only for its own listing", async () => {
  const make = "mkdir -p /tmp/tree && cd /tmp/tree && for d in a b c; do mkdir -p $d/x $d/y; touch $d/x/1 $d/x/2 $d/y/1 $d/f; done && echo ok";
  assert.equal((await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: make } })).body.stdout, "ok\n");
  const whole = await k.call("GET", `/v1/machines/${m.id}/files/list?path=/tmp/tree&depth=3`);
  const all = (whole.body.entries as { path: string }[]).map((e) => e.path);
  assert.equal(all.length, 21);
  assert.deepEqual(all.slice(0, 8), ["/tmp/tree/a", "/tmp/tree/a/f", "/tmp/tree/a/x", "/tmp/tree/a/x/1", "/tmp/tree/a/x/2", "/tmp/tree/a/y", "/tmp/tree/a/y/1", "/tmp/tree/b"]);
  for (const limit of [1, 2, 3, 5, 7, 20, 21, 22]) {
    const seen: string[] = [];
    let cursor: string | null = null;
    do {
      const res = await k.call("GET", `/v1/machines/${m.id}/files/list?path=/tmp/tree&depth=3&limit=${limit}${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ""}`);
      assert.equal(res.status, 200, res.text);
      seen.push(...(res.body.entries as { path: string }[]).map((e) => e.path));
      cursor = res.body.next_cursor;
    } while (cursor);
    assert.deepEqual(seen, all, `pages of ${limit}`);
  }
  const first = await k.call("GET", `/v1/machines/${m.id}/files/list?path=/tmp/tree&depth=3&limit=2`);
  const cursor = encodeURIComponent(first.body.next_cursor);
  for (const url of [`/v1/machines/${m.id}/files/list?path=/tmp&depth=3&cursor=${cursor}`, `/v1/machines/${m.id}/files/list?path=/tmp/tree&depth=2&cursor=${cursor}`, `/v1/machines/${m.id}/files/list?path=/tmp/tree&cursor=bm90LWEtY3Vyc29y`]) {
    const res = await k.call("GET", url);
    assert.equal(res.status, 400, url);
    assert.equal(res.body.code, "invalid_request");
  }
});
