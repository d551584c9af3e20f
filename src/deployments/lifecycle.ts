// A service instance's lifecycle as data: its statuses (SPEC.md), the event operations written when they change,
// the open readiness detail, and the pure step from (what the agent says, what the probe saw) to the next status.

import type { ServiceState } from "../agent/protocol.ts";
import type { ProbeResult } from "./probe.ts";

export const SERVICE_STATUSES = ["starting", "ready", "unhealthy", "stopping", "stopped", "failed"] as const;
export type ServiceStatus = (typeof SERVICE_STATUSES)[number];

/** Event operations written to the events table on every service status change (the lifecycle-webhook names). */
export const SERVICE_EVENT_OPERATIONS = {
  starting: "service.starting",
  ready: "service.ready",
  unhealthy: "service.unhealthy",
  stopping: "service.stopping",
  stopped: "service.stopped",
  failed: "service.failed",
  restart: "service.restart",
} as const;

/** Probes that must fail in a row before a ready service is unhealthy (a process that is not running counts at once). */
export const UNHEALTHY_AFTER = 2;

/** The server-recorded, open readiness/lifecycle detail of a service (SPEC.md readiness_status). */
export interface ReadinessDetail {
  phase?: string;
  probe?: "tcp" | "http";
  path?: string;
  attempts?: number;
  consecutive_failures?: number;
  last_probe_at?: string;
  last_ok_at?: string;
  last_error?: string | null;
  last_status_code?: number;
  starts?: number;
  crashes?: number;
  consecutive_crashes?: number;
  last_exit?: ServiceState["last_exit"];
  restarts?: { count: number; last_reason: string | null; last_at: string };
  [key: string]: unknown;
}

export interface Assessment {
  status: ServiceStatus;
  detail: ReadinessDetail;
  /** The process's pid now (null while it waits to start again, or when the agent does not answer). */
  pid: number | null;
  /** Set when the service is failed for good. */
  failure: string | null;
  /** Whether the change is worth a write: status, pid, crashes or the last error changed. */
  changed: boolean;
}

/**
 * One supervision step for a service that is starting, ready or unhealthy. `state` is null when the agent did not
 * answer; `probe` is null when no probe ran (the process was not running).
 */
export function assess(input: { status: ServiceStatus; pid: number | null; detail: ReadinessDetail; state: ServiceState | null; probe: ProbeResult | null; path?: string; now: string }): Assessment {
  const { state, probe, now } = input;
  const before = input.detail;
  const detail: ReadinessDetail = { ...before };
  if (state) Object.assign(detail, { starts: state.starts, crashes: state.crashes, consecutive_crashes: state.consecutive_crashes, last_exit: state.last_exit });
  if (state?.status === "failed") {
    detail.phase = "failed";
    return { status: "failed", detail, pid: null, failure: state.failure_reason ?? "the process failed", changed: true };
  }
  if (probe) {
    detail.probe = probe.kind;
    if (input.path) detail.path = input.path;
    detail.attempts = (detail.attempts ?? 0) + 1;
    detail.last_probe_at = now;
    if (probe.status !== undefined) detail.last_status_code = probe.status;
    if (probe.ok) {
      detail.last_ok_at = now;
      detail.consecutive_failures = 0;
      detail.last_error = null;
    } else {
      detail.consecutive_failures = (detail.consecutive_failures ?? 0) + 1;
      detail.last_error = probe.error;
    }
  } else {
    detail.consecutive_failures = (detail.consecutive_failures ?? 0) + 1;
    detail.last_error = state ? "the process exited and is waiting to be started again" : "the machine's agent does not answer";
  }
  const running = state?.status === "running";
  let status = input.status;
  if (running && probe?.ok) status = "ready";
  else if (input.status === "ready" && (!running || (detail.consecutive_failures ?? 0) >= UNHEALTHY_AFTER)) status = "unhealthy";
  detail.phase = status === "ready" ? "ready" : status === "unhealthy" ? "unhealthy" : "probing";
  const pid = state?.pid ?? null;
  const changed = status !== input.status || (pid !== null && pid !== input.pid) || before.crashes !== detail.crashes || before.last_error !== detail.last_error || before.phase !== detail.phase;
  return { status, detail, pid, failure: null, changed };
}
