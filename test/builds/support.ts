// Test helpers for template builds: POST /v1/templates/build read as an SSE stream into parsed entries, blob uploads,
// and small shell calls into machines.

import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { request } from "undici";
import type { TestKiln } from "../support/kiln.ts";
import { TEST_KEY } from "../support/kiln.ts";

export interface SseEvent {
  id: number;
  event: string;
  data: any;
}

export interface BuildResult {
  status: number;
  /** The HTTP error envelope when the build was refused before the stream. */
  envelope?: any;
  events: SseEvent[];
  raw: string;
}

/** Parses SSE text into events (comments and partial trailing events are skipped). */
export function parseSse(text: string): SseEvent[] {
  const out: SseEvent[] = [];
  for (const block of text.split("\n\n")) {
    let id = NaN;
    let event = "message";
    const data: string[] = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("id: ")) id = Number(line.slice(4));
      else if (line.startsWith("event: ")) event = line.slice(7);
      else if (line.startsWith("data: ")) data.push(line.slice(6));
    }
    if (data.length) out.push({ id, event, data: JSON.parse(data.join("\n")) });
  }
  return out;
}

/** Runs a build to its terminal entry (or an HTTP refusal). `stopAfter` disconnects once an event matches. */
export async function build(k: TestKiln, body: unknown, opts: { stopAfter?: (e: SseEvent) => boolean } = {}): Promise<BuildResult> {
  const res = await request(k.url + "/v1/templates/build", { method: "POST", headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" }, body: JSON.stringify(body) });
  if (res.statusCode !== 200) {
    const text = await res.body.text();
    return { status: res.statusCode, envelope: JSON.parse(text), events: [], raw: text };
  }
  assert.match(String(res.headers["content-type"]), /^text\/event-stream/);
  let raw = "";
  for await (const chunk of res.body) {
    raw += chunk.toString();
    if (opts.stopAfter) {
      const complete = raw.slice(0, raw.lastIndexOf("\n\n") + 2);
      if (parseSse(complete).some(opts.stopAfter)) {
        res.body.destroy();
        break;
      }
    }
  }
  return { status: 200, events: parseSse(raw), raw };
}

/** Builds and asserts it ended `end`; returns the end entry and all events. */
export async function buildOk(k: TestKiln, body: unknown): Promise<{ events: SseEvent[]; end: any; artifactId: string; buildId: string }> {
  const r = await build(k, body);
  assert.equal(r.status, 200, r.raw);
  const last = r.events.at(-1)!;
  assert.equal(last?.event, "end", `build did not end: ${r.events.slice(-5).map((e) => JSON.stringify(e.data)).join("\n")}`);
  return { events: r.events, end: last.data, artifactId: last.data.metadata.artifact_id, buildId: last.data.build_id };
}

export function sha256hex(data: Buffer | string): string {
  return createHash("sha256").update(data).digest("hex");
}

export async function putBlob(k: TestKiln, data: Buffer | string): Promise<string> {
  const sha = sha256hex(data);
  const r = await k.call("PUT", `/v1/templates/blobs/${sha}`, { raw: Buffer.from(data), headers: { "content-type": "application/octet-stream" } });
  assert.ok(r.status === 201 || r.status === 200, r.text);
  return sha;
}

export async function machineFrom(k: TestKiln, template: string, extra: Record<string, unknown> = {}): Promise<string> {
  const r = await k.call("POST", "/v1/machines", { body: { template, ...extra } });
  assert.equal(r.status, 201, r.text);
  return r.body.id;
}

export async function sh(k: TestKiln, id: string, cmd: string, extra: Record<string, unknown> = {}): Promise<{ exit_code: number; stdout: string; stderr: string }> {
  const r = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd, ...extra } });
  assert.equal(r.status, 200, r.text);
  return r.body;
}
