// Template builds as streams: POST /v1/templates/build and GET …/builds/{build_id}/logs answer Server-Sent Events.
// Both are read as async iterators of log entries; a stream that drops before its terminal entry (end, error,
// cancelled) is resumed from the logs route with Last-Event-ID, so no entry is lost or seen twice.

import { createParser } from "eventsource-parser";
import type { KilnOptions } from "./client.ts";
import { errorFromResponse, KilnApiError } from "./errors.ts";

/** One build log entry (DESIGN.md §4 "SSE wire format"; SPEC.md "Build log entry"). */
export interface BuildLogEntry {
  kind: "start" | "message" | "cache" | "retry" | "warning" | "error" | "cancelled" | "end";
  level: "debug" | "info" | "warn" | "error";
  message: string;
  timestamp: string;
  build_id: string;
  template_id: string;
  phase?: string;
  step_index?: number;
  total_steps?: number;
  attempt?: number;
  max_attempts?: number;
  cache_layer?: string;
  cache_outcome?: string;
  cache_reason?: string;
  cache_target?: string;
  error_detail?: Record<string, unknown>;
  /** The SSE `id:` of the entry: its sequence number in the build's log. */
  seq: number;
}

const TERMINAL = new Set(["end", "error", "cancelled"]);
/** Times a dropped stream is resumed before the iterator gives up. */
const MAX_RESUMES = 5;

async function* entriesOf(res: Response): AsyncGenerator<BuildLogEntry> {
  const queue: BuildLogEntry[] = [];
  const parser = createParser({
    onEvent(ev) {
      try {
        queue.push({ ...(JSON.parse(ev.data) as Omit<BuildLogEntry, "seq">), seq: Number(ev.id) });
      } catch {
        // not an entry
      }
    },
  });
  const decoder = new TextDecoder();
  for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
    parser.feed(decoder.decode(chunk, { stream: true }));
    while (queue.length) yield queue.shift()!;
  }
}

function url(opts: KilnOptions, path: string): URL {
  return new URL(path, opts.baseUrl.replace(/\/?$/, "/"));
}

/** Reads a build's log from `after` (the last seq seen), resuming a dropped stream; ends at the terminal entry. */
export async function* buildLogs(opts: KilnOptions, templateId: string, buildId: string, after?: number): AsyncGenerator<BuildLogEntry> {
  yield* resume(opts, templateId, buildId, after, MAX_RESUMES);
}

async function* resume(opts: KilnOptions, templateId: string, buildId: string, after: number | undefined, tries: number): AsyncGenerator<BuildLogEntry> {
  let last = after;
  for (let attempt = 0; ; attempt++) {
    const fetchImpl = opts.fetch ?? fetch;
    let res: Response;
    try {
      res = await fetchImpl(url(opts, `v1/templates/${encodeURIComponent(templateId)}/builds/${encodeURIComponent(buildId)}/logs`), {
        headers: { authorization: `Bearer ${opts.apiKey}`, accept: "text/event-stream", ...(last !== undefined ? { "last-event-id": String(last) } : {}) },
      });
    } catch (err) {
      if (attempt >= tries) throw err;
      await new Promise((r) => setTimeout(r, 250 * (attempt + 1)));
      continue;
    }
    if (!res.ok) throw await errorFromResponse(res);
    try {
      for await (const entry of entriesOf(res)) {
        if (last !== undefined && entry.seq <= last) continue;
        last = entry.seq;
        yield entry;
        if (TERMINAL.has(entry.kind)) return;
      }
    } catch (err) {
      if (attempt >= tries) throw err;
    }
    if (attempt >= tries) throw new KilnApiError(0, undefined, `the log of build ${buildId} ended before its last entry`);
    await new Promise((r) => setTimeout(r, 250 * (attempt + 1)));
  }
}

/**
 * Starts a build (POST /v1/templates/build) and yields its log entries as they come. A refused request throws the
 * envelope before any entry; a dropped stream is resumed from the logs route (the build goes on server-side).
 */
export async function* build(opts: KilnOptions, request: Record<string, unknown>): AsyncGenerator<BuildLogEntry> {
  const fetchImpl = opts.fetch ?? fetch;
  const res = await fetchImpl(url(opts, "v1/templates/build"), {
    method: "POST",
    headers: { authorization: `Bearer ${opts.apiKey}`, "content-type": "application/json", accept: "text/event-stream" },
    body: JSON.stringify(request),
  });
  if (!res.ok) throw await errorFromResponse(res);
  let ids: { template: string; build: string } | undefined;
  let last: number | undefined;
  try {
    for await (const entry of entriesOf(res)) {
      ids ??= { template: entry.template_id, build: entry.build_id };
      last = entry.seq;
      yield entry;
      if (TERMINAL.has(entry.kind)) return;
    }
  } catch (err) {
    if (!ids) throw err;
  }
  if (!ids) throw new KilnApiError(0, undefined, "the build stream ended before its first entry");
  yield* resume(opts, ids.template, ids.build, last, MAX_RESUMES);
}
