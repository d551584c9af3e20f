// The pure step of a service's lifecycle: from the agent's process state and a probe result to the next status
// and readiness detail (starting → ready ⇄ unhealthy, failed after the agent gives up).

import { test } from "node:test";
import assert from "node:assert/strict";
import { assess, UNHEALTHY_AFTER } from "../../src/deployments/lifecycle.ts";
import type { ServiceState } from "../../src/agent/protocol.ts";
import type { ProbeResult } from "../../src/deployments/probe.ts";

const now = "2026-01-01T00:00:00.000Z";
const running: ServiceState = { id: "svc_x", status: "running", pid: 10, starts: 1, crashes: 0, consecutive_crashes: 0, last_exit: null, started_at: now, failure_reason: null };
const ok: ProbeResult = { ok: true, kind: "http", status: 200, ms: 1 };
const bad: ProbeResult = { ok: false, kind: "http", status: 503, error: "GET /health answered 503", ms: 1 };

test("a starting service becomes ready on its first good probe, and stays starting on a bad one", () => {
  const good = assess({ status: "starting", pid: 10, detail: {}, state: running, probe: ok, path: "/health", now });
  assert.equal(good.status, "ready");
  assert.equal(good.changed, true);
  assert.deepEqual({ attempts: good.detail.attempts, last_ok_at: good.detail.last_ok_at, last_status_code: good.detail.last_status_code, path: good.detail.path }, { attempts: 1, last_ok_at: now, last_status_code: 200, path: "/health" });
  const notYet = assess({ status: "starting", pid: 10, detail: {}, state: running, probe: bad, now });
  assert.equal(notYet.status, "starting");
  assert.equal(notYet.detail.last_error, "GET /health answered 503");
  assert.equal(notYet.detail.phase, "probing");
});

test(`a ready service turns unhealthy after ${UNHEALTHY_AFTER} failed probes in a row, at once when its process is down, and ready again on a good probe`, () => {
  const once = assess({ status: "ready", pid: 10, detail: { consecutive_failures: 0 }, state: running, probe: bad, now });
  assert.equal(once.status, "ready");
  const twice = assess({ status: "ready", pid: 10, detail: once.detail, state: running, probe: bad, now });
  assert.equal(twice.status, "unhealthy");
  const crashed = assess({ status: "ready", pid: 10, detail: {}, state: { ...running, status: "backoff", pid: null, crashes: 1 }, probe: null, now });
  assert.equal(crashed.status, "unhealthy");
  assert.equal(crashed.detail.crashes, 1);
  assert.match(String(crashed.detail.last_error), /waiting to be started again/);
  const silent = assess({ status: "ready", pid: 10, detail: {}, state: null, probe: null, now });
  assert.equal(silent.status, "unhealthy");
  assert.match(String(silent.detail.last_error), /agent does not answer/);
  const back = assess({ status: "unhealthy", pid: 10, detail: twice.detail, state: running, probe: ok, now });
  assert.equal(back.status, "ready");
  assert.equal(back.detail.consecutive_failures, 0);
});

test("a process the agent gave up on fails the service with the agent's reason", () => {
  const out = assess({ status: "ready", pid: 10, detail: {}, state: { ...running, status: "failed", pid: null, crashes: 5, failure_reason: "the process exited 5 times in a row (last: code 1)" }, probe: null, now });
  assert.equal(out.status, "failed");
  assert.equal(out.failure, "the process exited 5 times in a row (last: code 1)");
  assert.equal(out.detail.crashes, 5);
});

test("only meaningful changes are writes: a repeated good probe is bookkeeping, a new pid is not", () => {
  const first = assess({ status: "starting", pid: 10, detail: {}, state: running, probe: ok, now });
  const again = assess({ status: "ready", pid: 10, detail: first.detail, state: running, probe: ok, now });
  assert.equal(again.changed, false);
  assert.equal(again.detail.attempts, 2);
  const newPid = assess({ status: "ready", pid: 10, detail: first.detail, state: { ...running, pid: 11, crashes: 1 }, probe: ok, now });
  assert.equal(newPid.changed, true);
  assert.equal(newPid.pid, 11);
});
