// Supervised service processes of a machine (the processes behind deployments): started as the machine's user,
// restarted with backoff when they crash, failed after too many crashes in a row, with a ring of recent output.

import type { ChildProcess } from "node:child_process";
import { AgentFailure } from "./errors.ts";
import { spawnAs } from "./process.ts";
import { killGroup } from "./process-tree.ts";
import type { ServiceLogs, ServiceRestartRequest, ServiceStartRequest, ServiceState, ServiceProcessStatus } from "./protocol.ts";

const RING_BYTES = 256 * 1024;
const STOP_GRACE_MS = 5_000;

/** The most recent output of a service, oldest chunks dropped first. */
class OutputRing {
  private chunks: Buffer[] = [];
  private held = 0;
  total = 0;
  push(b: Buffer) {
    this.chunks.push(b);
    this.held += b.length;
    this.total += b.length;
    // Whole chunks go while what remains still fills the ring; the oldest one left is cut to fit exactly.
    while (this.chunks.length > 1 && this.held - this.chunks[0].length >= RING_BYTES) this.held -= this.chunks.shift()!.length;
    if (this.held > RING_BYTES) {
      this.chunks[0] = this.chunks[0].subarray(this.held - RING_BYTES);
      this.held = RING_BYTES;
    }
  }
  tail(bytes: number): Buffer {
    const all = Buffer.concat(this.chunks);
    return all.subarray(Math.max(0, all.length - bytes));
  }
}

/** One supervised process and its restarts; lives as long as the agent unless stopped. */
class Service {
  readonly spec: ServiceStartRequest;
  status: ServiceProcessStatus = "running";
  child: ChildProcess | undefined;
  starts = 0;
  crashes = 0;
  consecutive = 0;
  lastExit: ServiceState["last_exit"] = null;
  startedAt: number | null = null;
  failureReason: string | null = null;
  readonly output = new OutputRing();
  /** Request-only envs of the latest restart: memory only, dropped by the next restart. */
  private restartEnvs: Record<string, string> | undefined;
  private timer: NodeJS.Timeout | undefined;
  private exited: Promise<void> = Promise.resolve();

  constructor(spec: ServiceStartRequest) {
    this.spec = spec;
  }

  state(): ServiceState {
    return {
      id: this.spec.id,
      status: this.status,
      pid: this.status === "running" ? (this.child?.pid ?? null) : null,
      starts: this.starts,
      crashes: this.crashes,
      consecutive_crashes: this.consecutive,
      last_exit: this.lastExit,
      started_at: this.startedAt === null ? null : new Date(this.startedAt).toISOString(),
      failure_reason: this.failureReason,
    };
  }

  private note(line: string) {
    this.output.push(Buffer.from(`[kiln] ${line}\n`));
  }

  start() {
    clearTimeout(this.timer);
    this.status = "running";
    this.failureReason = null;
    let child: ChildProcess;
    try {
      child = spawnAs({ cmd: this.spec.cmd, user: this.spec.user, cwd: this.spec.cwd, envs: { ...this.spec.envs, ...this.restartEnvs } }, { stdin: false });
    } catch (err) {
      this.status = "failed";
      this.failureReason = (err as Error).message;
      this.note(`cannot start: ${this.failureReason}`);
      return;
    }
    this.child = child;
    this.starts++;
    this.startedAt = Date.now();
    child.stdout!.on("data", (b: Buffer) => this.output.push(b));
    child.stderr!.on("data", (b: Buffer) => this.output.push(b));
    this.exited = new Promise((resolve) => {
      child.once("error", (e: NodeJS.ErrnoException) => {
        this.note(`spawn failed: ${e.code ?? e.message}`);
      });
      child.once("close", (code, signal) => {
        resolve();
        if (this.child !== child) return; // stopped or replaced on purpose
        this.child = undefined;
        this.onCrash(code, signal);
      });
    });
  }

  private onCrash(code: number | null, signal: NodeJS.Signals | null) {
    const upMs = Date.now() - (this.startedAt ?? Date.now());
    this.lastExit = { code, signal, at: new Date().toISOString() };
    this.crashes++;
    this.consecutive = upMs >= this.spec.stable_ms ? 1 : this.consecutive + 1;
    const how = signal ? `signal ${signal}` : `code ${code}`;
    if (this.consecutive >= this.spec.max_crashes) {
      this.status = "failed";
      this.failureReason = `the process exited ${this.consecutive} times in a row (last: ${how})`;
      this.note(`exited with ${how}; ${this.failureReason}, giving up`);
      return;
    }
    const delay = Math.min(this.spec.backoff_ms * 2 ** (this.consecutive - 1), this.spec.max_backoff_ms);
    this.status = "backoff";
    this.note(`exited with ${how}; starting again in ${delay} ms`);
    this.timer = setTimeout(() => this.start(), delay);
  }

  /** Ends the current process (SIGTERM to its group, SIGKILL after the grace period) without counting a crash. */
  async stopProcess(): Promise<void> {
    clearTimeout(this.timer);
    const child = this.child;
    this.child = undefined;
    if (!child || child.exitCode !== null || child.signalCode !== null) return;
    killGroup(child, "SIGTERM");
    const kill = setTimeout(() => killGroup(child, "SIGKILL"), STOP_GRACE_MS);
    await this.exited;
    clearTimeout(kill);
  }

  async restart(envs: Record<string, string> | undefined) {
    await this.stopProcess();
    this.restartEnvs = envs ? { ...envs } : undefined;
    this.consecutive = 0;
    this.note("restarting on request");
    this.start();
  }

  async stop() {
    await this.stopProcess();
    this.restartEnvs = undefined;
    this.status = "stopped";
    this.note("stopped on request");
  }
}

const services = new Map<string, Service>();

function get(id: string): Service {
  const s = services.get(id);
  if (!s) throw new AgentFailure("not_found", `No service ${id}`);
  return s;
}

function checkEnvs(envs: unknown, what: string): Record<string, string> | undefined {
  if (envs === undefined || envs === null) return undefined;
  if (typeof envs !== "object" || Array.isArray(envs) || Object.values(envs).some((v) => typeof v !== "string")) throw new AgentFailure("invalid_request", `${what} must map names to strings`);
  return envs as Record<string, string>;
}

export function startService(body: Partial<ServiceStartRequest>): ServiceState {
  if (typeof body.id !== "string" || !body.id) throw new AgentFailure("invalid_request", "id is required");
  if (typeof body.cmd !== "string" || !body.cmd) throw new AgentFailure("invalid_request", "cmd is required");
  const existing = services.get(body.id);
  if (existing && existing.status !== "stopped") return existing.state();
  const num = (v: unknown, fallback: number) => (typeof v === "number" && Number.isFinite(v) && v >= 0 ? v : fallback);
  const spec: ServiceStartRequest = {
    id: body.id,
    cmd: body.cmd,
    user: body.user,
    cwd: body.cwd,
    envs: checkEnvs(body.envs, "envs"),
    max_crashes: Math.max(1, num(body.max_crashes, 5)),
    backoff_ms: num(body.backoff_ms, 500),
    max_backoff_ms: num(body.max_backoff_ms, 30_000),
    stable_ms: num(body.stable_ms, 10_000),
  };
  const service = new Service(spec);
  services.set(spec.id, service);
  service.start();
  return service.state();
}

export function serviceState(id: string): ServiceState {
  return get(id).state();
}

export function listServices(): ServiceState[] {
  return [...services.values()].map((s) => s.state());
}

export async function restartService(id: string, body: ServiceRestartRequest): Promise<ServiceState> {
  const service = get(id);
  await service.restart(checkEnvs(body.envs, "envs"));
  return service.state();
}

export async function stopService(id: string): Promise<ServiceState> {
  const service = get(id);
  await service.stop();
  return service.state();
}

export function serviceLogs(id: string, tailBytes: number): ServiceLogs {
  const service = get(id);
  const data = service.output.tail(tailBytes);
  return { id, data_base64: data.toString("base64"), total_bytes: service.output.total, truncated: service.output.total > data.length };
}

/** At agent shutdown: every service's process group goes with it. */
export async function stopAllServices() {
  await Promise.all([...services.values()].map((s) => s.stopProcess()));
}
