// Adoption after a restart: machines still alive are taken back (their agents re-attached), the ones that are gone
// are recorded destroyed with why, and runtime containers with no live record are removed, so nothing leaks.

import { stoppedHibernation } from "./records.ts";
import type { MachineContext } from "./context.ts";
import type { MachineLifecycle } from "./lifecycle.ts";
import type { MachineHealth } from "./health.ts";

/** How often, and how far apart, the start tries to remove what a crash left of one machine. */
const LEFTOVER_ATTEMPTS = 3;
const LEFTOVER_RETRY_MS = 1000;

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
    const kept = new Set<string>();
    for (const row of rows) {
      const m = live.get(row.id);
      live.delete(row.id);
      // Hibernated to disk or with memory: nothing runs, and its disk (and saved memory) wait for a resume.
      if (stoppedHibernation(row)) {
        kept.add(row.id); // its dir holds what a resume needs: not a leftover
        adopted++;
        continue;
      }
      if (m && row.status !== "creating") {
        agents.attach(m);
        kept.add(row.id);
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
    // What a crash left of machines no record keeps alive (a warm or build machine that died with the server, a
    // destroy cut short): their dirs, mounts and uid range claims go now, or they would be held forever. A machine
    // another host's record keeps is never touched.
    const elsewhere = await db.selectFrom("machines").select("id").where("host_id", "!=", hostId).where("status", "in", ["creating", "running", "hibernated"]).execute();
    const keep = new Set([...kept, ...elsewhere.map((r) => r.id)]);
    let leaked = 0;
    for (const id of (await driver.listKnown?.()) ?? []) {
      if (keep.has(id)) continue;
      // A machine that died a moment ago may still have processes exiting (its runtime, cgroups and mounts refuse
      // to go until they have): a failure is tried again a few times before it is left for the next start.
      for (let attempt = 1; ; attempt++) {
        const failed = await driver.destroy(id, { leftover: true }).then(
          () => undefined,
          (err: unknown) => err,
        );
        if (failed === undefined) {
          leaked++;
          break;
        }
        if (attempt >= LEFTOVER_ATTEMPTS) {
          log.error({ err: failed, machine_id: id }, "removing what a crash left of a machine failed");
          break;
        }
        log.warn({ err: failed, machine_id: id, attempt }, "removing what a crash left of a machine failed; trying again");
        await new Promise((r) => setTimeout(r, LEFTOVER_RETRY_MS));
      }
    }
    // What died while no server watched (a network helper) is repaired now, before anything is served.
    await healLive();
    return { adopted, lost, removed: live.size + leaked };
  }

  return adopt;
}
