// Machine lifecycle after create: update, hibernate, resume and destroy, each under the machine's lock and written
// with its lifecycle event; and why a machine that died did (asked of the driver before destroy removes the evidence).

import type { MachineRow, MachineUpdate } from "../store/schema.ts";
import { KilnError } from "../errors.ts";
import { checkMetadata } from "./input-limits.ts";
import { OUT_OF_MEMORY, machineView } from "./records.ts";
import type { MachineView } from "./records.ts";
import type { MachineContext } from "./context.ts";

export interface UpdateMachineInput {
  name?: string;
  timeout_s?: number;
  metadata?: Record<string, string>;
}

export interface MachineLifecycle {
  update(id: string, input: UpdateMachineInput): Promise<MachineView>;
  hibernate(id: string): Promise<MachineView>;
  resume(id: string): Promise<MachineView>;
  destroy(id: string, reason?: string): Promise<MachineView>;
  /** Destroys a machine whose lock the caller holds; a destroyed or failed one is left as it is. */
  destroyLocked(row: MachineRow, reason?: string): Promise<MachineRow>;
  /** Why a machine that is gone died, asked of the driver before its destroy removes the evidence. */
  deathReason(id: string, fallback?: string): Promise<string>;
}

export function createMachineLifecycle(ctx: MachineContext): MachineLifecycle {
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
      return machineView(await records.transition(id, set, "update"));
    });
  }

  async function hibernate(id: string): Promise<MachineView> {
    return locks.run(id, async () => {
      const row = await records.load(id);
      if (row.status === "hibernated") return machineView(row);
      if (row.status !== "running") throw new KilnError("machine_not_running", `Machine ${id} is ${row.status}`);
      // Execs in flight end here (409 to their callers, their commands killed by the agent), not at resume.
      const socketPath = agents.get(id)?.socketPath;
      await agents.detach(id);
      try {
        await driver.hibernate(id);
      } catch (err) {
        if (socketPath) agents.reattach(id, socketPath);
        throw err;
      }
      return machineView(await records.transition(id, { status: "hibernated" }, "hibernate"));
    });
  }

  async function resume(id: string): Promise<MachineView> {
    return locks.run(id, async () => {
      const row = await records.load(id);
      if (row.status === "running") return machineView(row);
      if (row.status !== "hibernated") throw new KilnError("conflict", `Machine ${id} is ${row.status} and cannot be resumed`);
      const live = await driver.resume(id);
      const agent = agents.attach(live);
      // A resumed machine is a new execution: PTY sessions of the old one are not reconnectable (SPEC.md).
      await agent.resetSessions();
      return machineView(await records.transition(id, { status: "running" }, "resume"));
    });
  }

  async function destroy(id: string, reason?: string): Promise<MachineView> {
    return locks.run(id, async () => machineView(await destroyLocked(await records.load(id), reason)));
  }

  /** Destroys a machine whose lock the caller holds; a destroyed or failed one is left as it is. */
  async function destroyLocked(row: MachineRow, reason?: string): Promise<MachineRow> {
    if (row.status === "destroyed" || row.status === "failed") return row;
    await agents.detach(row.id);
    await driver.destroy(row.id);
    const set: MachineUpdate = { status: "destroyed", destroyed_at: new Date().toISOString() };
    if (reason) set.failure_reason = reason;
    return records.transition(row.id, set, "destroy");
  }

  /** Why a machine that is gone died, asked of the driver before its destroy removes the evidence. */
  async function deathReason(id: string, fallback = "the machine stopped unexpectedly"): Promise<string> {
    const cause = await driver.deathCause(id).catch(() => undefined);
    return cause === "out_of_memory" ? OUT_OF_MEMORY : fallback;
  }

  return { update, hibernate, resume, destroy, destroyLocked, deathReason };
}
