// Adoption after a restart: machines still alive are taken back (their agents re-attached), the ones that are gone
// are recorded destroyed with why, and runtime containers with no live record are removed, so nothing leaks.

import type { MachineContext } from "./context.ts";
import type { MachineLifecycle } from "./lifecycle.ts";
import type { MachineHealth } from "./health.ts";

export function createAdoption(ctx: MachineContext, lifecycle: MachineLifecycle, health: MachineHealth) {
  const { db, driver, log, hostId, records, agents } = ctx;
  const { deathReason } = lifecycle;
  const { healLive } = health;

  /**
   * After a restart: machines still alive are adopted, the ones that are gone are marked destroyed, and runtime
   * containers with no record (or a destroyed one) are removed, so nothing leaks.
   */
  async function adopt(): Promise<{ adopted: number; lost: number; removed: number }> {
    const live = new Map((await driver.listLive()).map((m) => [m.id, m]));
    // Records from before hosts were named belong to the first server that starts on this store again.
    await db.updateTable("machines").set({ host_id: hostId }).where("host_id", "is", null).execute();
    const rows = await db.selectFrom("machines").selectAll().where("host_id", "=", hostId).where("status", "in", ["creating", "running", "hibernated"]).execute();
    let adopted = 0;
    let lost = 0;
    for (const row of rows) {
      const m = live.get(row.id);
      live.delete(row.id);
      if (m && row.status !== "creating") {
        agents.attach(m);
        const status = m.state === "paused" ? "hibernated" : "running";
        if (status !== row.status) await records.transition(row.id, { status }, status === "running" ? "resume" : "hibernate");
        adopted++;
        continue;
      }
      const reason = row.status === "creating" ? "the server stopped while the machine was being created" : await deathReason(row.id, "the machine was gone after a restart");
      await driver.destroy(row.id).catch(() => undefined);
      await records.transition(row.id, { status: row.status === "creating" ? "failed" : "destroyed", destroyed_at: new Date().toISOString(), failure_reason: reason }, row.status === "creating" ? null : "destroy");
      lost++;
    }
    for (const orphan of live.keys()) await driver.destroy(orphan).catch((err: unknown) => log.error({ err, machine_id: orphan }, "removing an orphan machine failed"));
    // What died while no server watched (a network helper) is repaired now, before anything is served.
    await healLive();
    return { adopted, lost, removed: live.size };
  }

  return adopt;
}
