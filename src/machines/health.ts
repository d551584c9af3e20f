// Keeping this server's machines honest while it runs: the expiry sweeper (every second), and every few seconds a
// health pass that reaps machines that died on their own and repairs (or destroys) live ones' host-side parts.

import type { HibernateMode } from "../runtime/driver.ts";
import { stoppedHibernation } from "./records.ts";
import type { MachineContext } from "./context.ts";
import type { MachineLifecycle } from "./lifecycle.ts";

/** Expired machines destroyed at once by the sweeper. */
const EXPIRY_CONCURRENCY = 8;
/** Machines whose host-side parts are checked (and repaired) at once by a health pass. */
const HEAL_CONCURRENCY = 8;
/** Every this many sweeper ticks (seconds): machines that died are reaped, live ones' host-side parts healed. */
const HEALTH_EVERY_TICKS = 2;

export interface MachineHealth {
  sweepExpired(): Promise<void>;
  reapDead(): Promise<number>;
  healLive(): Promise<{ repaired: number; failed: number }>;
  startSweeper(intervalMs?: number): void;
  stopSweeper(): void;
}

export function createMachineHealth(ctx: MachineContext, lifecycle: MachineLifecycle): MachineHealth {
  const { db, driver, log, hostId, records, locks } = ctx;
  const { hibernateLocked, destroyLocked, deathReason } = lifecycle;
  let sweeper: NodeJS.Timeout | undefined;
  /** Machines an expiry sweep is destroying right now. */
  const expiring = new Set<string>();

  /**
   * Machines whose processes are gone without Kiln stopping them (killed from outside, the host's OOM killer, a
   * crash of the runtime) are destroyed — so their mount, cgroups and network helper go too — and say why.
   * Rows are read before the runtime's list, so a machine that became running in between was already live.
   */
  async function reapDead(): Promise<number> {
    const rows = (await db.selectFrom("machines").select(["id", "status", "hibernate_mode"]).where("host_id", "=", hostId).where("status", "in", ["running", "hibernated"]).execute()).filter(
      (r) => !stoppedHibernation(r),
    );
    if (rows.length === 0) return 0;
    const live = new Set((await driver.listLive()).map((m) => m.id));
    let reaped = 0;
    for (const { id } of rows) {
      if (live.has(id)) continue;
      await locks.run(id, async () => {
        const row = await records.load(id);
        // Checked again under the lock: a concurrent destroy (or hibernate to disk) may have got there first.
        if ((row.status !== "running" && row.status !== "hibernated") || stoppedHibernation(row)) return;
        if ((await driver.listLive()).some((m) => m.id === id)) return;
        const reason = await deathReason(id);
        log.warn({ machine_id: id, reason }, "machine stopped unexpectedly; destroying it");
        await destroyLocked(row, reason);
        reaped++;
      }).catch((err: unknown) => log.error({ err, machine_id: id }, "destroying a machine that stopped failed"));
    }
    return reaped;
  }

  /** One machine's host-side parts, under its lock: repaired by the driver, or the machine destroyed with why not. */
  async function healOne(id: string): Promise<"ok" | "repaired" | "failed" | "skipped"> {
    return locks.run(id, async () => {
      const row = await records.load(id);
      if ((row.status !== "running" && row.status !== "hibernated") || stoppedHibernation(row)) return "skipped";
      const health = await driver.heal(id);
      if (health.ok) {
        if (health.repaired.length === 0) return "ok";
        log.warn({ machine_id: id, repaired: health.repaired }, "a machine's host-side parts were repaired");
        return "repaired";
      }
      log.warn({ machine_id: id, reason: health.reason }, "a machine's host-side parts cannot be repaired; destroying it");
      await destroyLocked(row, health.reason);
      return "failed";
    });
  }

  /**
   * The host-side parts of every running or hibernated machine (its network helper, the host files it writes):
   * what died is started again, logs past their cap are trimmed, and a machine that cannot be repaired is destroyed
   * with the reason. Runs every few seconds and at start (after adoption).
   */
  async function healLive(): Promise<{ repaired: number; failed: number }> {
    const rows = await db.selectFrom("machines").select("id").where("host_id", "=", hostId).where("status", "in", ["running", "hibernated"]).execute();
    const queue = rows.map((r) => r.id);
    const counts = { repaired: 0, failed: 0 };
    const next = async (): Promise<void> => {
      const id = queue.shift();
      if (id === undefined) return;
      const result = await healOne(id).catch((err: unknown) => {
        log.error({ err, machine_id: id }, "checking a machine's host-side parts failed");
        return "skipped" as const;
      });
      if (result === "repaired") counts.repaired++;
      if (result === "failed") counts.failed++;
      return next();
    };
    await Promise.all(Array.from({ length: Math.min(HEAL_CONCURRENCY, queue.length) }, next));
    return counts;
  }

  /**
   * Destroys machines whose timeout has passed. Runs every second; cheap because of the status index. Up to
   * EXPIRY_CONCURRENCY destroys run at once across sweeps, so one slow destroy never delays another's expiry.
   */
  async function sweepExpired(): Promise<void> {
    const now = new Date().toISOString();
    const due = await db.selectFrom("machines").select("id").where("host_id", "=", hostId).where("status", "in", ["running", "hibernated"]).where("expires_at", "<=", now).execute();
    const queue = due.map((r) => r.id).filter((id) => !expiring.has(id));
    const expireNext = async (): Promise<void> => {
      const id = queue.shift();
      if (id === undefined) return;
      expiring.add(id);
      await expire(id)
        .catch((err: unknown) => log.error({ err, machine_id: id }, "destroying an expired machine failed"))
        .finally(() => expiring.delete(id));
      return expireNext();
    };
    const slots = Math.max(0, EXPIRY_CONCURRENCY - expiring.size);
    await Promise.all(Array.from({ length: Math.min(slots, queue.length) }, expireNext));
  }

  /**
   * A machine past its timeout: destroyed, or with on_timeout "hibernate" (and running) hibernated so it holds no
   * memory — its memory saved where the host can, else its disk kept — until its hibernation bound.
   */
  async function expire(id: string): Promise<void> {
    await locks.run(id, async () => {
      const row = await records.load(id);
      if (row.status !== "running" && row.status !== "hibernated") return;
      if (new Date(row.expires_at).getTime() > Date.now()) return; // extended meanwhile
      if (row.on_timeout === "hibernate" && row.status === "running") {
        const mode: HibernateMode = driver.memorySnapshotsUnsupported() ? "disk" : "memory";
        await hibernateLocked(row, mode);
        return;
      }
      await destroyLocked(row, "timeout");
    });
  }

  /**
   * Expiry every second; every HEALTH_EVERY_TICKS seconds a health pass: machines that stopped on their own are
   * reaped, and live ones' host-side parts checked and repaired.
   */
  function startSweeper(intervalMs = 1000) {
    let tick = 0;
    let checking = false;
    sweeper = setInterval(() => {
      void sweepExpired().catch((err: unknown) => log.error({ err }, "expiry sweep failed"));
      if (++tick % HEALTH_EVERY_TICKS !== 0 || checking) return;
      checking = true;
      void reapDead()
        .catch((err: unknown) => log.error({ err }, "looking for stopped machines failed"))
        .then(() => healLive())
        .catch((err: unknown) => log.error({ err }, "checking machines' host-side parts failed"))
        .finally(() => (checking = false));
    }, intervalMs);
    sweeper.unref();
  }

  function stopSweeper() {
    if (sweeper) clearInterval(sweeper);
  }

  return { sweepExpired, reapDead, healLive, startSweeper, stopSweeper };
}
