// Build log entries (SPEC.md's fields, DESIGN.md's SSE wire format), the durable per-build log in the store, and
// live followers: every entry gets a sequence number, is kept in memory while the build runs and written in order.

import type { Db } from "../store/schema.ts";
import type { Logger } from "../log.ts";
import type { BuildPhase, CacheLayer, CacheOutcome, CacheReason, LogKind, LogLevel } from "./enums.ts";
import { TERMINAL_KINDS } from "./enums.ts";
import type { ErrorDetail } from "../errors.ts";

export interface LogEntry {
  kind: LogKind;
  level: LogLevel;
  message: string;
  timestamp: string;
  build_id: string;
  template_id: string;
  phase?: BuildPhase;
  step_index?: number;
  total_steps?: number;
  attempt?: number;
  max_attempts?: number;
  cache_layer?: CacheLayer;
  cache_outcome?: CacheOutcome;
  cache_reason?: CacheReason;
  cache_target?: string;
  error_detail?: ErrorDetail;
  metadata?: Record<string, unknown>;
}

/** What a build's code writes; the sink adds timestamp, build and template ids. */
export type LogInput = Omit<LogEntry, "timestamp" | "build_id" | "template_id" | "level"> & { level?: LogLevel };

export interface SequencedEntry {
  seq: number;
  entry: LogEntry;
}

/** One SSE event: `id` / `event` / `data` lines and a blank line. */
export function sseFrame(e: SequencedEntry): string {
  return `id: ${e.seq}\nevent: ${e.entry.kind}\ndata: ${JSON.stringify(e.entry)}\n\n`;
}

export const SSE_KEEPALIVE = ": keepalive\n\n";

interface LiveLog {
  entries: SequencedEntry[];
  followers: Set<(e: SequencedEntry | null) => void>;
  /** Writes to the store, chained so they land in order. */
  writing: Promise<void>;
  pending: SequencedEntry[];
  done: boolean;
  /** Strings (build_envs values) replaced in every message before it is kept anywhere. */
  redact: string[];
}

export function createBuildLogs(deps: { db: Db; log: Logger }) {
  const live = new Map<string, LiveLog>();

  function open(buildId: string, redact: string[]) {
    live.set(buildId, { entries: [], followers: new Set(), writing: Promise.resolve(), pending: [], done: false, redact: redact.filter((s) => s.length >= 3) });
  }

  function scrub(text: string, redact: string[]): string {
    for (const s of redact) if (text.includes(s)) text = text.split(s).join("***");
    return text;
  }

  function flush(buildId: string, l: LiveLog) {
    l.writing = l.writing.then(async () => {
      const batch = l.pending.splice(0);
      if (batch.length === 0) return;
      await deps.db
        .insertInto("build_logs")
        .values(batch.map((e) => ({ build_id: buildId, seq: e.seq, kind: e.entry.kind, entry_json: JSON.stringify(e.entry) })))
        .execute()
        .catch((err: unknown) => deps.log.error({ err, build_id: buildId }, "writing the build log failed"));
    });
  }

  /** Appends an entry to a running build's log; returns it with its sequence number. */
  function append(buildId: string, entry: LogEntry): SequencedEntry {
    const l = live.get(buildId);
    if (!l) throw new Error(`build log ${buildId} is not open`);
    if (l.done) return { seq: l.entries.length, entry };
    entry.message = scrub(entry.message, l.redact);
    if (entry.cache_target) entry.cache_target = scrub(entry.cache_target, l.redact);
    if (entry.error_detail?.message) entry.error_detail.message = scrub(entry.error_detail.message, l.redact);
    const e = { seq: l.entries.length + 1, entry };
    l.entries.push(e);
    l.pending.push(e);
    flush(buildId, l);
    if (TERMINAL_KINDS.includes(entry.kind)) l.done = true;
    for (const f of l.followers) f(e);
    return e;
  }

  /** Resolves once everything appended is in the store; then the in-memory copy goes. */
  async function close(buildId: string): Promise<void> {
    const l = live.get(buildId);
    if (!l) return;
    l.done = true;
    // Followers still waiting (a build that ended without a terminal entry, which a store failure can cause) end too.
    for (const f of [...l.followers]) f(null);
    await l.writing;
    live.delete(buildId);
  }

  /**
   * Entries after `afterSeq`, then (while the build runs) live ones until its terminal entry. `onEntry` sees each
   * once, in order; the returned function stops following.
   */
  async function follow(buildId: string, afterSeq: number, onEntry: (e: SequencedEntry) => void, onEnd: () => void): Promise<() => void> {
    const l = live.get(buildId);
    if (l) {
      let last = afterSeq;
      let ended = false;
      const end = () => {
        if (ended) return;
        ended = true;
        l.followers.delete(deliver);
        onEnd();
      };
      const deliver = (e: SequencedEntry | null) => {
        if (e === null) return end();
        if (e.seq <= last || ended) return;
        last = e.seq;
        onEntry(e);
        if (TERMINAL_KINDS.includes(e.entry.kind)) end();
      };
      for (const e of l.entries) deliver(e);
      if (!ended) {
        if (l.done) end();
        else l.followers.add(deliver);
      }
      return () => l.followers.delete(deliver);
    }
    const rows = await deps.db.selectFrom("build_logs").select(["seq", "entry_json"]).where("build_id", "=", buildId).where("seq", ">", afterSeq).orderBy("seq").execute();
    for (const r of rows) onEntry({ seq: Number(r.seq), entry: JSON.parse(r.entry_json) as LogEntry });
    onEnd();
    return () => undefined;
  }

  function isLive(buildId: string) {
    return live.has(buildId);
  }

  return { open, append, close, follow, isLive };
}

export type BuildLogs = ReturnType<typeof createBuildLogs>;
