// Restart recovery: builds a previous process left running end `error`, in the phase their log last named, with the
// same terminal entry a failed build gets.

import type { Db } from "../store/schema.ts";
import type { LogEntry } from "./log.ts";
import { INTERRUPTED_REASON, errorDetail } from "./failure.ts";

/**
 * Ends every unfinished build of `hosts` (this host's, or a lost host's) not running here, and those no host owns
 * (made before hosts were named); another live host's builds are its own. Answers how many there were.
 */
export async function recoverInterrupted(db: Db, runningHere: (buildId: string) => boolean, hosts: string[], reason: string = INTERRUPTED_REASON): Promise<number> {
  const rows = await db
    .selectFrom("builds")
    .selectAll()
    .where("status", "in", ["waiting", "building"])
    .where((eb) => eb.or([eb("host_id", "is", null), ...(hosts.length ? [eb("host_id", "in", hosts)] : [])]))
    .execute();
  for (const row of rows) {
    if (runningHere(row.id)) continue;
    const last = await db.selectFrom("build_logs").select(["seq", "entry_json"]).where("build_id", "=", row.id).orderBy("seq", "desc").limit(1).executeTakeFirst();
    const lastEntry = last ? (JSON.parse(last.entry_json) as LogEntry) : undefined;
    const phase = lastEntry?.phase ?? "preparing";
    const now = new Date().toISOString();
    // Conditional: two servers ending the same lost host's builds end each once, with one log entry.
    const ended = await db
      .updateTable("builds")
      .set({ status: "error", failure_phase: phase, failure_reason: reason, finished_at: now, updated_at: now, duration_ms: Date.now() - Date.parse(row.started_at ?? row.queued_at) })
      .where("id", "=", row.id)
      .where("status", "in", ["waiting", "building"])
      .executeTakeFirst();
    if (Number(ended.numUpdatedRows) !== 1) continue;
    const entry: LogEntry = {
      kind: "error",
      level: "error",
      message: reason,
      timestamp: now,
      build_id: row.id,
      template_id: row.template_id,
      phase,
      step_index: lastEntry?.step_index,
      error_detail: errorDetail(row.id, { reason, phase, stepIndex: lastEntry?.step_index, retryable: true, suggestedAction: "build again" }),
    };
    await db.insertInto("build_logs").values({ build_id: row.id, seq: Number(last?.seq ?? 0) + 1, kind: "error", entry_json: JSON.stringify(entry) }).execute();
  }
  return rows.length;
}
