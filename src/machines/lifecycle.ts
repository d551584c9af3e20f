// Machine lifecycle after create: update, hibernate, resume and destroy, each under the machine's lock and written
// with its lifecycle event; and why a machine that died did (asked of the driver before destroy removes the evidence).

import type { MachineRow, MachineUpdate } from "../store/schema.ts";
import { KilnError } from "../errors.ts";
import type { HibernateMode } from "../runtime/driver.ts";
import type { TemplateService } from "../templates/service.ts";
import { artifactConfig } from "../builder/artifact-config.ts";
import { runStartCommand } from "../builder/start-command.ts";
import { checkMetadata } from "./input-limits.ts";
import { DEFAULT_MAX_HIBERNATION_S, OUT_OF_MEMORY, machineView } from "./records.ts";
import type { MachineView, OnTimeout } from "./records.ts";
import type { MachineContext } from "./context.ts";

export interface UpdateMachineInput {
  name?: string;
  timeout_s?: number;
  metadata?: Record<string, string>;
  on_timeout?: OnTimeout;
  auto_resume?: boolean;
}

export interface LifecycleDeps {
  /** A machine resumed from a disk hibernation runs its template's start command again. */
  templates: TemplateService;
  /** KILN_MAX_HIBERNATION_S: how long a machine with on_timeout "hibernate" may sleep. */
  maxHibernationS?: number;
}

export interface MachineLifecycle {
  update(id: string, input: UpdateMachineInput): Promise<MachineView>;
  hibernate(id: string, mode?: HibernateMode): Promise<MachineView>;
  resume(id: string): Promise<MachineView>;
  /** Hibernates a machine whose lock the caller holds. */
  hibernateLocked(row: MachineRow, mode: HibernateMode): Promise<MachineView>;
  /** Resumes a machine whose lock the caller holds. */
  resumeLocked(row: MachineRow): Promise<MachineView>;
  destroy(id: string, reason?: string): Promise<MachineView>;
  /** Destroys a machine whose lock the caller holds; a destroyed or failed one is left as it is. */
  destroyLocked(row: MachineRow, reason?: string): Promise<MachineRow>;
  /** Why a machine that is gone died, asked of the driver before its destroy removes the evidence. */
  deathReason(id: string, fallback?: string): Promise<string>;
}

export function createMachineLifecycle(ctx: MachineContext, deps: LifecycleDeps): MachineLifecycle {
  const { driver, records, agents, locks } = ctx;

  async function update(id: string, input: UpdateMachineInput): Promise<MachineView> {
    checkMetadata(input.metadata);
    return locks.run(id, async () => {
      const row = await records.load(id);
      if (row.status === "destroyed" || row.status === "failed") throw new KilnError("conflict", `Machine ${id} is ${row.status}`);
      const set: MachineUpdate = {};
      if (input.name !== undefined) set.name = input.name;
      if (input.metadata !== undefined) set.metadata_json = JSON.stringify(input.metadata);
      if (input.timeout_s !== undefined) {
        set.timeout_s = input.timeout_s;
        set.expires_at = new Date(Date.now() + input.timeout_s * 1000).toISOString();
      }
      if (input.on_timeout !== undefined) set.on_timeout = input.on_timeout;
      if (input.auto_resume !== undefined) set.auto_resume = input.auto_resume ? 1 : 0;
      return machineView(await records.transition(id, set, "update"));
    });
  }

  /**
   * `freeze` (default): processes frozen in memory. `disk`: processes stopped, disk kept (resume boots it again and
   * runs the template's start command). `memory`: processes saved to disk, no memory held (gVisor; 400 with the
   * reason elsewhere). A machine with on_timeout "hibernate" may then sleep up to the hibernation bound.
   */
  async function hibernate(id: string, mode: HibernateMode = "freeze"): Promise<MachineView> {
    if (mode === "memory") {
      const why = driver.memorySnapshotsUnsupported();
      if (why) throw new KilnError("invalid_request", `Cannot hibernate with memory on this host: ${why}`);
    }
    return locks.run(id, async () => hibernateLocked(await records.load(id), mode));
  }

  async function hibernateLocked(row: MachineRow, mode: HibernateMode): Promise<MachineView> {
    const id = row.id;
    if (row.status === "hibernated") return machineView(row);
    if (row.status !== "running") throw new KilnError("machine_not_running", `Machine ${id} is ${row.status}`);
    // Execs in flight end here (409 to their callers, their commands killed by the agent), not at resume.
    const socketPath = agents.get(id)?.socketPath;
    await agents.detach(id);
    try {
      await driver.hibernate(id, mode);
    } catch (err) {
      if (socketPath) agents.reattach(id, socketPath);
      throw err;
    }
    const set: MachineUpdate = { status: "hibernated", hibernate_mode: mode };
    if (row.on_timeout === "hibernate") set.expires_at = new Date(Date.now() + (deps.maxHibernationS ?? DEFAULT_MAX_HIBERNATION_S) * 1000).toISOString();
    return machineView(await records.transition(id, set, "hibernate"));
  }

  async function resume(id: string): Promise<MachineView> {
    return locks.run(id, async () => resumeLocked(await records.load(id)));
  }

  async function resumeLocked(row: MachineRow): Promise<MachineView> {
    const id = row.id;
    if (row.status === "running") return machineView(row);
    if (row.status !== "hibernated") throw new KilnError("conflict", `Machine ${id} is ${row.status} and cannot be resumed`);
    const mode = (row.hibernate_mode ?? "freeze") as HibernateMode;
    const live = await driver.resume(id, mode);
    const agent = agents.attach(live);
    // A resumed machine is a new execution: PTY sessions of the old one are not reconnectable (SPEC.md).
    await agent.resetSessions();
    // Booted again from its disk: the template's envs and start command, as at create (create-time envs were never
    // stored, so they are gone; a memory hibernation keeps them in the saved agent).
    if (mode === "disk") {
      const image = artifactConfig((await deps.templates.resolve(row.artifact_id)).artifact);
      if (Object.keys(image.image.env).length > 0) await agent.setEnvs(image.image.env);
      await runStartCommand(agent, image, row.user);
    }
    const set: MachineUpdate = { status: "running", hibernate_mode: null };
    // Its sleep bound ends at wake-up: the machine's own timeout runs again from now.
    if (row.on_timeout === "hibernate") set.expires_at = new Date(Date.now() + row.timeout_s * 1000).toISOString();
    return machineView(await records.transition(id, set, "resume"));
  }

  async function destroy(id: string, reason?: string): Promise<MachineView> {
    return locks.run(id, async () => machineView(await destroyLocked(await records.load(id), reason)));
  }

  /** Destroys a machine whose lock the caller holds; a destroyed or failed one is left as it is. */
  async function destroyLocked(row: MachineRow, reason?: string): Promise<MachineRow> {
    if (row.status === "destroyed" || row.status === "failed") return row;
    const t0 = performance.now();
    agents.drop(row.id);
    const tDetached = performance.now();
    // Unreachable now (processes killed, agent connection closed); the rest of the removal runs behind the caller.
    // A driver that cannot kill that fast, or a kill that failed, removes it all here.
    const silenced = driver.silence
      ? await driver.silence(row.id).then(
          () => true,
          (err: unknown) => (ctx.log.warn({ err, machine_id: row.id }, "killing a machine through its cgroup failed; removing it in full"), false),
        )
      : false;
    if (silenced) ctx.teardown.schedule(row.id, row.memory_mb);
    else await driver.destroy(row.id);
    const set: MachineUpdate = { status: "destroyed", destroyed_at: new Date().toISOString() };
    if (reason) set.failure_reason = reason;
    const tKilled = performance.now();
    const destroyed = await records.transition(row.id, set, "destroy");
    const ms = (a: number, b: number) => Math.round((b - a) * 10) / 10;
    ctx.log.debug({ machine_id: row.id, detach_ms: ms(t0, tDetached), kill_ms: ms(tDetached, tKilled), record_ms: ms(tKilled, performance.now()), behind: silenced }, "machine destroyed");
    return destroyed;
  }

  /** Why a machine that is gone died, asked of the driver before its destroy removes the evidence. */
  async function deathReason(id: string, fallback = "the machine stopped unexpectedly"): Promise<string> {
    const cause = await driver.deathCause(id).catch(() => undefined);
    return cause === "out_of_memory" ? OUT_OF_MEMORY : fallback;
  }

  return { update, hibernate, resume, hibernateLocked, resumeLocked, destroy, destroyLocked, deathReason };
}
