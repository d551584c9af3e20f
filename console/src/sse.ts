// Server-Sent Events over fetch: EventSource cannot send an Authorization header, so the console reads the stream
// itself (eventsource-parser) and, when the connection drops before a terminal entry, resumes with Last-Event-ID.

import { createParser } from "eventsource-parser";
import { authHeaders } from "./api.ts";

const TERMINAL = new Set(["end", "error", "cancelled"]);
/** A dropped stream is resumed this many times in a row (a success resets the count), this long apart. */
const MAX_RESUMES = 10;
const RESUME_DELAY_MS = 1000;

export interface SseOptions<T> {
  onEntry(entry: T, id: string | undefined): void;
  /** Called once when the stream ends: after a terminal entry, on abort, or when it could not be resumed. */
  onClose?(reason: "terminal" | "aborted" | "failed", error?: Error): void;
  signal: AbortSignal;
}

export async function followSse<T extends { kind: string }>(path: string, opts: SseOptions<T>): Promise<void> {
  let lastId: string | undefined;
  let resumes = 0;
  let ended = false;
  const parser = createParser({
    onEvent(ev) {
      if (ev.id) lastId = ev.id;
      let entry: T;
      try {
        entry = JSON.parse(ev.data) as T;
      } catch {
        return;
      }
      resumes = 0;
      opts.onEntry(entry, ev.id);
      if (TERMINAL.has(entry.kind)) ended = true;
    },
  });
  let lastError: Error | undefined;
  while (!ended) {
    try {
      const res = await fetch(path, { headers: { ...authHeaders(), accept: "text/event-stream", ...(lastId ? { "last-event-id": lastId } : {}) }, cache: "no-store", signal: opts.signal });
      if (res.status === 401 || res.status === 404) return opts.onClose?.("failed", new Error(`the log stream answered ${res.status}`));
      if (!res.ok || !res.body) throw new Error(`the log stream answered ${res.status}`);
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        parser.feed(value);
        if (ended) {
          await reader.cancel().catch(() => undefined);
          break;
        }
      }
      parser.reset();
    } catch (err) {
      lastError = err as Error;
    }
    if (opts.signal.aborted) return opts.onClose?.("aborted");
    if (ended) break;
    // The stream ended without a terminal entry: resume after the last entry seen.
    if (++resumes > MAX_RESUMES) return opts.onClose?.("failed", lastError ?? new Error("the log stream kept ending early"));
    await new Promise((r) => setTimeout(r, RESUME_DELAY_MS));
  }
  opts.onClose?.("terminal");
}
