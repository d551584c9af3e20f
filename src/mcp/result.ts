// What a tool answers: MCP content blocks, long text cut with a note that says how to get the rest, and every failure
// as a tool error carrying Kiln's code and message (never a protocol error: the model should read it and act).

import type { CallToolResult } from "@modelcontextprotocol/sdk/types.js";
import { KilnError } from "../errors.ts";
import type { KilnCaller } from "./caller.ts";
import type { DirectCalls } from "./direct.ts";

export type ToolResult = CallToolResult;

/** What every tool is given: how to call Kiln, and the base URL the MCP client reached Kiln at. */
export interface ToolContext {
  call: KilnCaller;
  baseUrl: string;
  /** In the server: the calls a tool makes without re-entering the HTTP API (direct.ts). `kiln mcp` has none. */
  direct?: DirectCalls;
}

/**
 * Keeps the head and the tail of a long text (errors are usually at the end, what ran at the start), with a note
 * in the middle saying how much was cut.
 */
export function truncate(text: string, max: number, hint: string): { text: string; truncated: boolean } {
  if (text.length <= max) return { text, truncated: false };
  const head = Math.floor(max / 2);
  const tail = max - head;
  const cut = text.length - max;
  return { text: `${text.slice(0, head)}\n[… ${cut} characters cut: ${hint} …]\n${text.slice(text.length - tail)}`, truncated: true };
}

export function textResult(text: string, structured?: Record<string, unknown>): ToolResult {
  return { content: [{ type: "text", text }], ...(structured ? { structuredContent: structured } : {}) };
}

export function toolError(err: unknown): ToolResult {
  const e = err instanceof KilnError ? err : new KilnError("internal", (err as Error)?.message ?? String(err));
  const requestId = e.detail?.request_id;
  return { content: [{ type: "text", text: `${e.code}: ${e.message}${requestId ? ` (request ${requestId})` : ""}` }], isError: true };
}

/** Runs a tool body; whatever it throws comes back as a tool error. */
export function guarded<A>(ctx: ToolContext, body: (ctx: ToolContext, args: A) => Promise<ToolResult>) {
  return async (args: A): Promise<ToolResult> => {
    try {
      return await body(ctx, args);
    } catch (err) {
      return toolError(err);
    }
  };
}

/** A path segment for Kiln's URLs: an id the model typed must never walk to another route. */
export function seg(id: string): string {
  return encodeURIComponent(id);
}
