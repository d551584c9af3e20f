// The build pipeline over time: the three cache tiers and their counters, failures and retries in history, cancel,
// a client that disconnects, replay with a stock EventSource and Last-Event-ID, history pagination and filters, tag
// moves that keep history, and a server stopping mid-build.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { Agent, EventSource, request } from "undici";
import type { Dispatcher } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { build, buildOk, machineFrom, parseSse, putBlob, sh } from "./support.ts";
import type { SseEvent } from "./support.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

const fiveSteps = (third = "three") => [
  { type: "run", command: "echo one > /one" },
  { type: "run", command: "echo two > /two" },
  { type: "run", command: `echo ${third} > /three` },
  { type: "run", command: "echo four > /four" },
  { type: "run", command: "cat /one /two /three > /five" },
];

const cacheEntries = (events: SseEvent[], layer: string) => events.filter((e) => e.event === "cache" && e.data.cache_layer === layer && e.data.cache_outcome !== "stored");
const stepRan = (events: SseEvent[]) => new Set(events.filter((e) => e.data.phase === "step" && e.event === "message").map((e) => e.data.step_index));

async function record(template: string, buildId: string) {
  const r = await k.call("GET", `/v1/templates/${template}/builds/${buildId}`);
  assert.equal(r.status, 200, r.text);
  return r.body;
}

async function waitForEnd(template: string, buildId: string): Promise<SseEvent[]> {
  const res = await request(`${k.url}/v1/templates/${template}/builds/${buildId}/logs`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  assert.equal(res.statusCode, 200);
  return parseSse(await res.body.text());
}

test("a fully cached rebuild runs no step and counts a final_artifact hit; changing step 3 of 5 reuses steps 1–2", async () => {
  const cold = await buildOk(k, { name: "cached", steps: fiveSteps() });
  assert.deepEqual([...stepRan(cold.events)].sort(), [1, 2, 3, 4, 5]);
  const coldRec = await record("cached", cold.buildId);
  assert.equal(coldRec.cache_summary.final_artifact_misses, 1);
  assert.equal(coldRec.cache_summary.final_artifact_stores, 1);
  assert.equal(coldRec.cache_summary.layer_misses, 5);
  assert.equal(coldRec.cache_summary.layer_stores, 5);

  const warm = await buildOk(k, { name: "cached", steps: fiveSteps() });
  assert.equal(stepRan(warm.events).size, 0, "no step runs");
  assert.equal(warm.artifactId, cold.artifactId, "the existing artifact is reused");
  const hit = cacheEntries(warm.events, "final_artifact");
  assert.equal(hit.length, 1);
  assert.equal(hit[0].data.cache_outcome, "hit");
  assert.equal(hit[0].data.phase, "cache");
  assert.equal(typeof hit[0].data.cache_target, "string");
  const warmRec = await record("cached", warm.buildId);
  assert.deepEqual(
    { hits: warmRec.cache_summary.final_artifact_hits, misses: warmRec.cache_summary.final_artifact_misses, layerHits: warmRec.cache_summary.layer_hits, layerMisses: warmRec.cache_summary.layer_misses },
    { hits: 1, misses: 0, layerHits: 0, layerMisses: 0 },
  );

  const changed = await buildOk(k, { name: "cached", steps: fiveSteps("THREE") });
  const layer = cacheEntries(changed.events, "layer");
  assert.deepEqual(layer.map((e) => [e.data.step_index, e.data.cache_outcome]), [[1, "hit"], [2, "hit"], [3, "miss"], [4, "miss"], [5, "miss"]]);
  assert.ok(layer.filter((e) => e.data.cache_outcome === "miss").every((e) => e.data.cache_reason === "missing_or_incompatible"));
  assert.deepEqual([...stepRan(changed.events)].sort(), [3, 4, 5]);
  const rec = await record("cached", changed.buildId);
  assert.equal(rec.cache_summary.layer_hits, 2);
  assert.equal(rec.cache_summary.layer_misses, 3);
  const m = await machineFrom(k, "cached");
  assert.equal((await sh(k, m, "cat /five")).stdout, "one\ntwo\nTHREE\n");

  const skipped = await buildOk(k, { name: "cached", steps: fiveSteps("THREE"), skip_cache: true });
  const bypass = skipped.events.filter((e) => e.event === "cache" && e.data.cache_outcome === "bypass");
  assert.equal(bypass.length, 6);
  assert.ok(bypass.every((e) => e.data.cache_reason === "whole_build_skip_cache"));
  assert.deepEqual([...stepRan(skipped.events)].sort(), [1, 2, 3, 4, 5]);
  const skRec = await record("cached", skipped.buildId);
  assert.equal(skRec.cache_summary.final_artifact_bypasses, 1);
  assert.equal(skRec.cache_summary.layer_bypasses, 5);
});

test("step output arrives while the step runs, not at its end", async () => {
  const r = await buildOk(k, { name: "live-lines", steps: [{ type: "run", command: "echo first; sleep 1.5; echo second" }] });
  const first = r.events.find((e) => e.data.message === "first")!;
  const second = r.events.find((e) => e.data.message === "second")!;
  assert.ok(Date.parse(second.data.timestamp) - Date.parse(first.data.timestamp) >= 1000);
});

test("the SSE wire format: ids in order, event = kind, start first with build_id, end last", async () => {
  const r = await build(k, { name: "wire", steps: [{ type: "run", command: "echo hi" }] });
  assert.match(r.raw, /^id: 1\nevent: start\ndata: \{/);
  assert.deepEqual(r.events.map((e) => e.id), r.events.map((_e, i) => i + 1));
  for (const e of r.events) {
    assert.equal(e.event, e.data.kind);
    for (const f of ["kind", "level", "message", "timestamp", "build_id", "template_id"]) assert.ok(f in e.data, `${f} in ${e.event}`);
  }
  assert.match(r.events[0].data.build_id, /^bld_/);
  assert.equal(r.events.at(-1)!.event, "end");
});

test("a failing step ends the stream with build_error and the failed attempt stays in history", async () => {
  const r = await build(k, { name: "failing", steps: [{ type: "run", command: "echo ok" }, { type: "run", command: "echo about to fail; exit 3" }] });
  const last = r.events.at(-1)!;
  assert.equal(last.event, "error");
  assert.equal(last.data.error_detail.code, "build_error");
  assert.equal(last.data.error_detail.phase, "step");
  assert.equal(last.data.error_detail.step_index, 2);
  assert.equal(typeof last.data.error_detail.retryable, "boolean");
  assert.equal(typeof last.data.error_detail.suggested_action, "string");
  assert.equal(r.events.filter((e) => e.event === "retry").length, 0, "a user command that exits non-zero does not retry");
  const hist = await k.call("GET", "/v1/templates/failing/builds");
  const rec = hist.body.builds[0];
  assert.equal(rec.status, "error");
  assert.equal(rec.failure_phase, "step");
  assert.deepEqual(rec.artifact_ids, []);
  assert.equal(rec.artifact_availability.status, "unavailable");
  assert.equal(rec.promotability.promotable, false);
  assert.ok(rec.duration_ms >= 0);
});

test("a network fetch that fails is retried up to max_attempts with retry entries", async () => {
  const r = await build(k, { name: "flaky", vm: { internet: false }, steps: [{ type: "download", url: "http://198.51.100.1/none", dest: "/none" }] });
  const retries = r.events.filter((e) => e.event === "retry");
  assert.deepEqual(retries.map((e) => [e.data.attempt, e.data.max_attempts, e.data.phase]), [[2, 3, "retry"], [3, 3, "retry"]]);
  assert.equal(r.events.at(-1)!.event, "error");
  assert.equal(r.events.at(-1)!.data.error_detail.retryable, true);
});

test("cancel: the build machine is destroyed and the record ends cancelled", async () => {
  const before = (await k.kiln.services.driver.listLive()).map((m) => m.id);
  let buildId = "";
  const streaming = build(k, { name: "cancelled", steps: [{ type: "run", command: "echo sleeping; sleep 60" }] }, {
    stopAfter: (e) => {
      buildId = e.data.build_id;
      return e.data.message === "sleeping";
    },
  });
  await streaming;
  // The step runs in a machine booted for it, or in the one the last build left booted ahead of time (already live).
  const during = (await k.kiln.services.driver.listLive()).map((m) => m.id);
  assert.ok(during.length >= 1 && during.filter((id) => !before.includes(id)).length <= 1, "one build machine runs the step");
  const c = await k.call("POST", `/v1/templates/cancelled/builds/${buildId}/cancel`);
  assert.equal(c.status, 200, c.text);
  assert.equal(c.body.status, "cancelled");
  // Nothing is booted after a cancel: what is live now is what was, less the build machine.
  const after = (await k.kiln.services.driver.listLive()).map((m) => m.id);
  assert.ok(after.every((id) => during.includes(id)) && after.length === during.length - 1, "the build machine is gone");
  const replay = await waitForEnd("cancelled", buildId);
  assert.equal(replay.at(-1)!.event, "cancelled");
  assert.equal((await k.call("POST", `/v1/templates/cancelled/builds/${buildId}/cancel`)).status, 409);
});

test("a client that disconnects mid-build does not stop it: the build still finishes", async () => {
  let buildId = "";
  await build(k, { name: "dropped", steps: [{ type: "run", command: "echo started; sleep 1; echo finished" }] }, {
    stopAfter: (e) => {
      buildId = e.data.build_id;
      return e.data.message === "started";
    },
  });
  const replay = await waitForEnd("dropped", buildId);
  assert.ok(replay.some((e) => e.data.message === "finished"));
  assert.equal(replay.at(-1)!.event, "end");
  assert.equal((await record("dropped", buildId)).status, "ready");
});

test("replay with a stock EventSource client follows a running build, and reconnects with Last-Event-ID", async () => {
  let buildId = "";
  await build(k, { name: "replayed", steps: [{ type: "run", command: "echo a; sleep 1; echo b" }] }, { stopAfter: (e) => ((buildId = e.data.build_id), true) });
  const sentLastIds: (string | undefined)[] = [];
  const dispatcher = new Agent().compose((dispatch: Dispatcher["dispatch"]) => (opts, handler) => {
    const headers: Record<string, string> = { ...(opts.headers as Record<string, string>), authorization: `Bearer ${TEST_KEY}` };
    sentLastIds.push(headers["last-event-id"] ?? headers["Last-Event-ID"]);
    return dispatch({ ...opts, headers }, handler);
  });
  const es = new EventSource(`${k.url}/v1/templates/replayed/builds/${buildId}/logs`, { dispatcher });
  const got: { id: string; type: string; data: any }[] = [];
  await new Promise<void>((resolve) => {
    // (An `error` entry would share its name with EventSource's own connection error event; this build ends `end`.)
    for (const kind of ["start", "message", "cache", "end"]) es.addEventListener(kind, (ev) => {
      const m = ev as MessageEvent;
      got.push({ id: m.lastEventId, type: m.type, data: JSON.parse(m.data) });
      if (kind === "end") resolve();
    });
  });
  // The server ends the stream after `end`; the client reconnects on its own, sending the last id it saw.
  for (let i = 0; i < 100 && sentLastIds.length < 2; i++) await new Promise((r) => setTimeout(r, 100));
  es.close();
  await dispatcher.close();
  assert.equal(got[0].type, "start");
  assert.ok(got.some((e) => e.data.message === "a") && got.some((e) => e.data.message === "b"));
  assert.equal(sentLastIds[1], got.at(-1)!.id, "the reconnect carried Last-Event-ID");
  assert.equal(new Set(got.map((e) => e.id)).size, got.length, "nothing was delivered twice");

  const res = await request(`${k.url}/v1/templates/replayed/builds/${buildId}/logs`, { headers: { authorization: `Bearer ${TEST_KEY}`, "last-event-id": "3" } });
  const after3 = parseSse(await res.body.text());
  assert.equal(after3[0].id, 4);
  assert.equal(after3.at(-1)!.event, "end");
});

test("history: newest first, opaque cursor pages, and the status, build_backend and source_type filters", async () => {
  const ids: string[] = [];
  for (let i = 0; i < 3; i++) ids.push((await buildOk(k, { name: "paged", steps: [{ type: "env", envs: { N: String(i) } }] })).buildId);
  const failed = await build(k, { name: "paged", steps: [{ type: "run", command: "exit 1" }] });
  ids.push(failed.events[0].data.build_id);
  ids.push((await buildOk(k, { name: "paged", base_image: "local/base" })).buildId);
  const seen: string[] = [];
  let cursor: string | null = null;
  let pages = 0;
  do {
    const r = await k.call("GET", `/v1/templates/paged/builds?limit=2${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ""}`);
    assert.equal(r.status, 200, r.text);
    seen.push(...r.body.builds.map((b: { build_id: string }) => b.build_id));
    cursor = r.body.next_cursor;
    pages++;
  } while (cursor);
  assert.equal(pages, 3);
  assert.deepEqual(seen, [...ids].reverse(), "newest first, each once");
  const only = async (q: string) => (await k.call("GET", `/v1/templates/paged/builds?${q}`)).body.builds.map((b: { build_id: string }) => b.build_id);
  assert.deepEqual(await only("status=error"), [ids[3]]);
  assert.equal((await only("status=ready")).length, 4);
  assert.deepEqual(await only("source_type=template_base"), [ids[4]]);
  assert.equal((await only("source_type=declarative")).length, 4);
  assert.equal((await only("build_backend=native")).length, 5);
  assert.deepEqual(await only("build_backend=buildkit"), []);
  // The id may also be an artifact id of the template.
  const art = (await k.call("GET", "/v1/templates/paged")).body.tags.default;
  assert.equal((await k.call("GET", `/v1/templates/${art}/builds?limit=1`)).body.builds[0].build_id, ids[4]);
  const rec = (await k.call("GET", `/v1/templates/paged/builds?limit=1`)).body.builds[0];
  for (const f of ["build_id", "template_id", "name", "tags", "status", "build_backend", "source_type", "created_at", "updated_at", "source_digest", "context_digest", "dockerfile_digest", "triggered_by", "queued_at", "started_at", "finished_at", "duration_ms", "failure_phase", "cache_summary", "artifact_availability", "promotability", "retention_expires_at", "artifact_ids"]) {
    assert.ok(f in rec, `record has ${f}`);
  }
  assert.equal(Object.keys(rec.cache_summary).length, 12);
  assert.match(rec.dockerfile_digest, /^sha256:[0-9a-f]{64}$/);
});

test("tags move on rebuild and history keeps the builds whose tags moved", async () => {
  const v1 = await buildOk(k, { name: "moving", tags: ["v1", "latest"], steps: [{ type: "write_file", path: "/version", content: "1" }] });
  const v2 = await buildOk(k, { name: "moving", tags: ["latest"], steps: [{ type: "write_file", path: "/version", content: "2" }] });
  const t = (await k.call("GET", "/v1/templates/moving")).body;
  assert.deepEqual(t.tags, { latest: v2.artifactId, v1: v1.artifactId });
  assert.equal((await sh(k, await machineFrom(k, "moving:v1"), "cat /version")).stdout, "1");
  assert.equal((await sh(k, await machineFrom(k, "moving:latest"), "cat /version")).stdout, "2");
  assert.equal((await sh(k, await machineFrom(k, v1.artifactId), "cat /version")).stdout, "1", "an artifact id is a template too");
  await buildOk(k, { name: "moving", tags: ["v1"], steps: [{ type: "write_file", path: "/version", content: "3" }] });
  const hist = (await k.call("GET", "/v1/templates/moving/builds")).body.builds;
  assert.equal(hist.length, 3);
  const old = hist.find((b: { build_id: string }) => b.build_id === v1.buildId);
  assert.deepEqual(old.artifact_ids, [v1.artifactId]);
  assert.equal(old.artifact_availability.status, "available");
  assert.ok(Date.parse(old.retention_expires_at) > Date.now(), "an untagged artifact starts its retention clock");
});

test("the retention collector removes expired artifacts no machine uses and their layers", async () => {
  const a = await buildOk(k, { name: "retained", steps: [{ type: "write_file", path: "/gen", content: "a" }] });
  await buildOk(k, { name: "retained", steps: [{ type: "write_file", path: "/gen", content: "b" }] });
  const before = (await k.call("GET", `/v1/templates/retained/builds/${a.buildId}`)).body;
  assert.equal(before.artifact_availability.status, "available");
  const far = new Date(Date.now() + 30 * 86_400_000);
  const r = await k.kiln.services.builds.collect(far);
  assert.ok(r.artifacts >= 1 && r.layers >= 1, JSON.stringify(r));
  const after = (await k.call("GET", `/v1/templates/retained/builds/${a.buildId}`)).body;
  assert.equal(after.artifact_availability.status, "expired");
  const m = await machineFrom(k, "retained");
  assert.equal((await sh(k, m, "cat /gen")).stdout, "b", "the tagged artifact is untouched");
});

test("the retention collector removes context blobs unused for the retention period, and keeps recently used ones", async () => {
  const sha = await putBlob(k, `context blob ${Date.now()}`);
  const head = async () => (await k.call("HEAD", `/v1/templates/blobs/${sha}`)).status;
  assert.equal(await head(), 200);
  const now = await k.kiln.services.builds.collect(new Date());
  assert.equal(await head(), 200, `a blob used now stays (${JSON.stringify(now)})`);
  const far = await k.kiln.services.builds.collect(new Date(Date.now() + 30 * 86_400_000));
  assert.ok(far.contextBlobs >= 1, JSON.stringify(far));
  assert.equal(await head(), 404, "a blob nothing used for the retention period is gone");
});

test("a server that stops mid-build leaves that build error with its phase, never building", async () => {
  const k2 = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  let buildId = "";
  await build(k2, { name: "interrupted", steps: [{ type: "run", command: "echo working; sleep 60" }] }, {
    stopAfter: (e) => ((buildId = e.data.build_id), e.data.message === "working"),
  });
  await k2.stop();
  const k3 = await startTestKiln({ dataDir: k2.dataDir, env: { KILN_WARM_POOL: "0" } });
  try {
    const rec = (await k3.call("GET", `/v1/templates/interrupted/builds/${buildId}`)).body;
    assert.equal(rec.status, "error");
    assert.equal(rec.failure_phase, "step");
    const res = await request(`${k3.url}/v1/templates/interrupted/builds/${buildId}/logs`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
    const events = parseSse(await res.body.text());
    assert.equal(events.at(-1)!.event, "error");
    assert.equal(events.at(-1)!.data.error_detail.code, "build_error");
    assert.deepEqual(await k3.kiln.services.driver.listLive(), [], "no build machine is left running");
    // A record left `building` by a process that died without a shutdown ends error at the next start.
    await k3.kiln.services.store.db.updateTable("builds").set({ status: "building" }).where("id", "=", buildId).execute();
    assert.equal(await k3.kiln.services.builds.recoverInterrupted(), 1);
    assert.equal((await k3.call("GET", `/v1/templates/interrupted/builds/${buildId}`)).body.status, "error");
  } finally {
    await k3.close();
  }
});
