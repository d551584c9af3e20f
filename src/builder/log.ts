// Build log entries (SPEC.md's fields, DESIGN.md's SSE wire format), the durable per-build log in the store, and
// its readers: every entry gets a sequence number and is written in order; a reader — live or replaying — is one
// cursor that pages through the store and the few entries not yet written, so what a live client sees is exactly
// what a replay returns, and a reader that stops reading costs nothing but its cursor.

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

/** Where a reader's entries go: `write` answers false when the reader is full (then `resume` continues). */
export interface LogSink {
  write(e: SequencedEntry): boolean;
  end(): void;
}

/** Rows per INSERT: 4 values each, far inside SQLite's (999 on old builds) and PostgreSQL's (65535) variable limits. */
const ROWS_PER_INSERT = 200;
/** Rows per store transaction: one commit for many rows keeps a fast-printing step from outrunning the store. */
const ROWS_PER_WRITE = 2000;
/** Entries a reader takes from the store at a time. */
const PAGE = 500;
/** A producer is asked to wait while this many entries (or bytes) are not yet in the store; it may go on at half. */
const BACKLOG_ENTRIES = 10_000;
const BACKLOG_BYTES = 16 * 1024 * 1024;
export const DEFAULT_LOG_MAX_BYTES = 128 * 1024 * 1024;

interface StoredEntry extends SequencedEntry {
  json: string;
}

interface LiveLog {
  /** Appended and not yet confirmed in the store, in sequence order; everything before the first is stored. */
  unstored: StoredEntry[];
  unstoredBytes: number;
  /** The last sequence number given out. */
  last: number;
  /** Bytes of entries kept so far, against the cap; `truncated` once `message` entries started being dropped. */
  bytes: number;
  truncated: boolean;
  writing: Promise<void>;
  writerBusy: boolean;
  done: boolean;
  /** Strings (build_envs and secret values) replaced in every message before it is kept anywhere. */
  redact: string[];
  /** Readers waiting for the next entry. */
  wakers: Set<() => void>;
  /** Producers waiting for the backlog to shrink. */
  drained: (() => void)[];
}

export function createBuildLogs(deps: { db: Db; log: Logger; maxBytes?: number }) {
  const live = new Map<string, LiveLog>();
  const maxBytes = deps.maxBytes ?? DEFAULT_LOG_MAX_BYTES;

  function open(buildId: string, redact: string[]) {
    live.set(buildId, {
      unstored: [],
      unstoredBytes: 0,
      last: 0,
      bytes: 0,
      truncated: false,
      writing: Promise.resolve(),
      writerBusy: false,
      done: false,
      redact: redact.filter((s) => s.length >= 3),
      wakers: new Set(),
      drained: [],
    });
  }

  function scrub(text: string, redact: string[]): string {
    for (const s of redact) if (text.includes(s)) text = text.split(s).join("***");
    return text;
  }

  async function insert(buildId: string, batch: StoredEntry[]) {
    const rows = batch.map((e) => ({ build_id: buildId, seq: e.seq, kind: e.entry.kind, entry_json: e.json }));
    await deps.db.transaction().execute(async (tx) => {
      for (let i = 0; i < rows.length; i += ROWS_PER_INSERT) await tx.insertInto("build_logs").values(rows.slice(i, i + ROWS_PER_INSERT)).execute();
    });
  }

  /** Writes what is unstored, in order, one transaction at a time, until nothing is left. */
  function flush(buildId: string, l: LiveLog) {
    if (l.writerBusy) return;
    l.writerBusy = true;
    l.writing = (async () => {
      while (l.unstored.length) {
        const batch = l.unstored.slice(0, ROWS_PER_WRITE);
        let stored = false;
        for (let attempt = 1; !stored && attempt <= 3; attempt++) {
          try {
            await insert(buildId, batch);
            stored = true;
          } catch (err) {
            // A row a failed attempt may have committed is not written twice: the rest of the batch goes on its own.
            const present = await deps.db.selectFrom("build_logs").select("seq").where("build_id", "=", buildId).where("seq", ">=", batch[0].seq).where("seq", "<=", batch.at(-1)!.seq).execute().catch(() => []);
            if (present.length === batch.length) stored = true;
            else if (attempt === 3) deps.log.error({ err, build_id: buildId, entries: batch.length }, "writing the build log failed; these entries are lost");
            else await new Promise((r) => setTimeout(r, 100 * attempt));
          }
        }
        l.unstored.splice(0, batch.length);
        for (const e of batch) l.unstoredBytes -= e.json.length;
        if (l.unstored.length <= BACKLOG_ENTRIES / 2 && l.unstoredBytes <= BACKLOG_BYTES / 2) for (const d of l.drained.splice(0)) d();
      }
      l.writerBusy = false;
      for (const d of l.drained.splice(0)) d();
    })();
  }

  function push(buildId: string, l: LiveLog, entry: LogEntry): SequencedEntry {
    const e: StoredEntry = { seq: ++l.last, entry, json: JSON.stringify(entry) };
    l.bytes += e.json.length;
    l.unstoredBytes += e.json.length;
    l.unstored.push(e);
    flush(buildId, l);
    if (TERMINAL_KINDS.includes(entry.kind)) l.done = true;
    for (const wake of [...l.wakers]) wake();
    l.wakers.clear();
    return { seq: e.seq, entry };
  }

  /**
   * Appends an entry to a running build's log; returns it with its sequence number. Past the byte cap, `message`
   * entries are dropped (once a `warning` says the log is truncated); every other kind is still kept.
   */
  function append(buildId: string, entry: LogEntry): SequencedEntry | undefined {
    const l = live.get(buildId);
    if (!l) throw new Error(`build log ${buildId} is not open`);
    if (l.done) return undefined;
    entry.message = scrub(entry.message, l.redact);
    if (entry.cache_target) entry.cache_target = scrub(entry.cache_target, l.redact);
    if (entry.error_detail?.message) entry.error_detail.message = scrub(entry.error_detail.message, l.redact);
    if (entry.kind === "message" && l.bytes >= maxBytes) {
      if (!l.truncated) {
        l.truncated = true;
        push(buildId, l, {
          ...entry,
          kind: "warning",
          level: "warn",
          message: `log truncated: this build's log reached ${maxBytes} bytes (KILN_BUILD_LOG_MAX_BYTES); later output lines are not kept`,
          metadata: { log_truncated: true, max_bytes: maxBytes },
        });
      }
      return undefined;
    }
    return push(buildId, l, entry);
  }

  /** While the store is behind this build's log, a promise that resolves once it has caught up halfway. */
  function backpressure(buildId: string): Promise<void> | undefined {
    const l = live.get(buildId);
    if (!l || (l.unstored.length < BACKLOG_ENTRIES && l.unstoredBytes < BACKLOG_BYTES)) return undefined;
    return new Promise((resolve) => l.drained.push(resolve));
  }

  /** Resolves once everything appended is in the store; then the build is no longer live. */
  async function close(buildId: string): Promise<void> {
    const l = live.get(buildId);
    if (!l) return;
    l.done = true;
    // Readers waiting for an entry that will not come (a build that ended without a terminal entry) finish.
    for (const wake of [...l.wakers]) wake();
    l.wakers.clear();
    flush(buildId, l);
    await l.writing;
    live.delete(buildId);
    for (const d of l.drained.splice(0)) d();
  }

  /** Up to `limit` entries after `afterSeq`: from the store, or from memory for those not yet written. */
  async function read(buildId: string, afterSeq: number, limit: number): Promise<SequencedEntry[]> {
    const l = live.get(buildId);
    const memory = (from: number) => {
      const first = l!.unstored[0]?.seq ?? l!.last + 1;
      const at = Math.max(0, from + 1 - first);
      return l!.unstored.slice(at, at + limit).map(({ seq, entry }) => ({ seq, entry }));
    };
    if (l && afterSeq + 1 >= (l.unstored[0]?.seq ?? l.last + 1)) return memory(afterSeq);
    const rows = await deps.db.selectFrom("build_logs").select(["seq", "entry_json"]).where("build_id", "=", buildId).where("seq", ">", afterSeq).orderBy("seq").limit(limit).execute();
    // Nothing stored past afterSeq while the build still holds unwritten entries: those between were lost by a
    // failed write, and the reader goes on with the next ones rather than waiting for them.
    if (rows.length === 0 && l) return memory(afterSeq);
    return rows.map((r) => ({ seq: Number(r.seq), entry: JSON.parse(r.entry_json) as LogEntry }));
  }

  /**
   * Delivers the entries after `afterSeq` to `sink`, in order, then (while the build runs) each new one, until the
   * terminal entry. When `sink.write` answers false the cursor waits for `resume()`; `stop()` ends it. Nothing is
   * queued for a reader: it reads the store (or the unwritten tail) at its own pace.
   */
  function follow(buildId: string, afterSeq: number, sink: LogSink): { stop(): void; resume(): void } {
    let last = afterSeq;
    let stopped = false;
    let pumping = false;
    let blocked = false;
    const finish = () => {
      if (stopped) return;
      stopped = true;
      sink.end();
    };
    const pump = async () => {
      if (pumping || stopped || blocked) return;
      pumping = true;
      try {
        while (!stopped && !blocked) {
          const batch = await read(buildId, last, PAGE);
          if (stopped) return;
          if (batch.length === 0) {
            const l = live.get(buildId);
            if (l && l.last > last) continue;
            if (!l || l.done) return finish();
            l.wakers.add(wake);
            return;
          }
          for (const e of batch) {
            if (stopped) return;
            last = e.seq;
            const more = sink.write(e);
            if (TERMINAL_KINDS.includes(e.entry.kind)) return finish();
            if (!more) {
              blocked = true;
              break;
            }
          }
        }
      } catch (err) {
        deps.log.warn({ err, build_id: buildId }, "reading the build log failed; the stream ends (resume with Last-Event-ID)");
        finish();
      } finally {
        pumping = false;
      }
    };
    const wake = () => void pump();
    void pump();
    return {
      stop() {
        stopped = true;
        live.get(buildId)?.wakers.delete(wake);
      },
      resume() {
        blocked = false;
        void pump();
      },
    };
  }

  function isLive(buildId: string) {
    return live.has(buildId);
  }

  return { open, append, close, follow, read, backpressure, isLive };
}

export type BuildLogs = ReturnType<typeof createBuildLogs>;
