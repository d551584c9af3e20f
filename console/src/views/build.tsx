// One build: its record and its log, replayed and then followed live over SSE (resumed with Last-Event-ID when
// the connection drops), with cancel while it runs.

import { useEffect, useRef, useState } from "preact/hooks";
import { api, enc, get, type Build, type BuildEntry } from "../api.ts";
import { followSse } from "../sse.ts";
import { href } from "../router.ts";
import { ConfirmButton, ErrorNote, Section, Status, useAction, useLoad, when } from "../ui.tsx";

/** Entries kept on screen; a longer log keeps its newest ones (the whole log stays on the server). */
const MAX_LINES = 20_000;

export function BuildPage({ templateId, buildId }: { templateId: string; buildId: string }) {
  const base = `/v1/templates/${enc(templateId)}/builds/${enc(buildId)}`;
  const record = useLoad((signal) => get<Build>(base, signal), [base]);
  const [entries, setEntries] = useState<BuildEntry[]>([]);
  const [stream, setStream] = useState<{ state: "following" | "ended" | "failed"; error?: Error }>({ state: "following" });
  const [error, run] = useAction();
  const logRef = useRef<HTMLDivElement>(null);
  const stick = useRef(true);

  useEffect(() => {
    const ctl = new AbortController();
    setEntries([]);
    setStream({ state: "following" });
    // Entries arriving in a burst (a replay) are rendered once per frame, not once each.
    let pending: BuildEntry[] = [];
    let frame = 0;
    const flush = () => {
      frame = 0;
      const batch = pending;
      pending = [];
      setEntries((old) => {
        const all = old.concat(batch);
        return all.length > MAX_LINES ? all.slice(all.length - MAX_LINES) : all;
      });
    };
    void followSse<BuildEntry>(`${base}/logs`, {
      signal: ctl.signal,
      onEntry(entry) {
        pending.push(entry);
        frame ||= requestAnimationFrame(flush);
      },
      onClose(reason, err) {
        if (reason === "aborted") return;
        setStream({ state: reason === "terminal" ? "ended" : "failed", error: err });
        record.reload();
      },
    });
    return () => {
      ctl.abort();
      cancelAnimationFrame(frame);
    };
  }, [base]);

  useEffect(() => {
    const el = logRef.current;
    if (el && stick.current) el.scrollTop = el.scrollHeight;
  }, [entries]);

  const b = record.data;
  const last = entries.at(-1);
  const status = stream.state === "ended" && last ? (last.kind === "end" ? "ready" : last.kind) : (b?.status ?? "…");
  return (
    <Section
      title={
        <>
          <a href={href("templates")}>Templates</a> / <a href={href("templates", templateId)}>{b?.template_id ?? templateId}</a> / {buildId}
        </>
      }
      actions={
        b && stream.state === "following" && (b.status === "building" || b.status === "waiting") ? (
          <ConfirmButton label="Cancel build" confirm="Really cancel?" onConfirm={() => run(() => api("POST", `${base}/cancel`))} />
        ) : null
      }
    >
      <ErrorNote error={record.error ?? error ?? stream.error} />
      <dl class="facts">
        <dt>Status</dt>
        <dd>
          <Status value={status} /> <span class="muted" data-log-state>{stream.state === "following" ? "following the log live" : stream.state === "ended" ? "log complete" : "log stream lost"}</span>
        </dd>
        <dt>Source</dt>
        <dd>{b ? `${b.source_type} (${b.build_backend})` : "—"}</dd>
        <dt>Started</dt>
        <dd>{when(b?.started_at ?? b?.created_at)}</dd>
      </dl>
      <div
        class="log"
        ref={logRef}
        role="log"
        aria-label="Build log"
        tabIndex={0}
        onScroll={(e) => {
          const el = e.currentTarget as HTMLDivElement;
          stick.current = el.scrollHeight - el.scrollTop - el.clientHeight < 40;
        }}
      >
        {entries.map((e) => (
          <div class={`line level-${e.level} kind-${e.kind}`}>
            <span class="muted">{e.timestamp ? e.timestamp.slice(11, 19) : ""}</span>{" "}
            {e.step_index ? <span class="step">[{e.step_index}/{e.total_steps ?? "?"}]</span> : e.phase ? <span class="step">[{e.phase}]</span> : null} {e.message}
            {e.error_detail?.message && e.error_detail.message !== e.message ? <span class="error"> {e.error_detail.message}</span> : null}
          </div>
        ))}
      </div>
    </Section>
  );
}
