// run_code: POST /v1/machines/{id}/code/execute — the NDJSON frames of one execution turned into MCP content:
// printed text and text results as text, image results (PNG, JPEG, SVG as text) as images, an exception as its traceback.

import { z } from "zod";
import type { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { errorOf } from "../caller.ts";
import { guarded, seg, truncate } from "../result.ts";
import type { ToolContext, ToolResult } from "../result.ts";
import { MachineId } from "./machines.ts";

/** Characters of printed output shown per execution. */
const CODE_TEXT_MAX_CHARS = 20_000;
/** Images returned per execution (a plotting loop can make hundreds). */
const CODE_IMAGES_MAX = 8;
/** The most of an execution's NDJSON answer read (images included). */
const CODE_ANSWER_MAX_BYTES = 32 * 1024 * 1024;

type Frame =
  | { type: "stdout" | "stderr"; text: string }
  | { type: "result"; data: Record<string, unknown> }
  | { type: "error"; name: string; value: string; traceback: string }
  | { type: "end"; status?: string };

const IMAGE_TYPES = ["image/png", "image/jpeg", "image/gif", "image/webp"];

// Made once: a zod schema is compiled on first use, and every request builds a server of these tools.
const runCodeInput = z.object({
  machine_id: MachineId,
  code: z.string().max(4 * 1024 * 1024).describe("The code to run"),
  language: z.enum(["python", "javascript"]).optional().describe("Kernel language (default python); ignored with context_id"),
  context_id: z.string().regex(/^[A-Za-z0-9_-]{1,64}$/).optional().describe("A kernel context id (ctx_…) to run in instead of the language's default one"),
  timeout_s: z.number().int().min(1).max(3600).optional().describe("Interrupt the execution after this many seconds (default 300)"),
});

export function codeTools(server: McpServer, ctx: ToolContext) {
  server.registerTool(
    "run_code",
    {
      title: "Run code",
      description:
        "Run Python or JavaScript in a stateful kernel inside a machine (like a notebook cell: variables, imports and functions persist between calls of the same language). " +
        "Returns printed output, the value of the last expression, and images (e.g. matplotlib figures) as images. An exception comes back as its traceback.",
      inputSchema: runCodeInput,
      annotations: { openWorldHint: true },
    },
    guarded(ctx, async ({ call }, args) => {
      const body = { code: args.code, ...(args.context_id ? { context_id: args.context_id } : { language: args.language ?? "python" }), ...(args.timeout_s ? { timeout_s: args.timeout_s } : {}) };
      const res = await call("POST", `/v1/machines/${seg(args.machine_id)}/code/execute`, { json: body, maxBytes: CODE_ANSWER_MAX_BYTES });
      if (res.status >= 400) throw errorOf(res);
      return contentOf(res.body.toString("utf8"), res.truncated);
    }),
  );
}

/** One execution's frames as content blocks, in the order a notebook shows them. */
export function contentOf(ndjson: string, cut: boolean): ToolResult {
  let text = "";
  const images: { data: string; mimeType: string }[] = [];
  let imagesLeft = 0;
  let status: string | undefined;
  for (const line of ndjson.split("\n")) {
    if (!line.trim()) continue;
    let frame: Frame;
    try {
      frame = JSON.parse(line) as Frame;
    } catch {
      continue; // the last line of a cut answer
    }
    if (frame.type === "stdout" || frame.type === "stderr") text += frame.text;
    else if (frame.type === "error") text += `${frame.traceback || `${frame.name}: ${frame.value}`}\n`;
    else if (frame.type === "end") status = frame.status;
    else if (frame.type === "result") {
      const mime = IMAGE_TYPES.find((t) => typeof frame.data[t] === "string");
      if (mime) {
        if (images.length < CODE_IMAGES_MAX) images.push({ data: String(frame.data[mime]).replace(/\s+/g, ""), mimeType: mime });
        else imagesLeft++;
      } else {
        const plain = frame.data["text/plain"] ?? frame.data["image/svg+xml"] ?? frame.data["text/html"] ?? frame.data["application/json"];
        if (plain !== undefined) text += `${typeof plain === "string" ? plain : JSON.stringify(plain)}\n`;
      }
    }
  }
  const shown = truncate(text, CODE_TEXT_MAX_CHARS, "write large output to a file and read it in parts");
  const notes = [
    imagesLeft > 0 ? `[${imagesLeft} more images not shown]` : "",
    cut ? "[the answer was too large and was cut]" : "",
    status && status !== "ok" && status !== "error" ? `[execution ended: ${status}]` : "",
  ].filter(Boolean);
  const blocks: ToolResult["content"] = [];
  const head = [shown.text.replace(/\n$/, ""), ...notes].filter(Boolean).join("\n");
  blocks.push({ type: "text", text: head || "(no output)" });
  for (const img of images) blocks.push({ type: "image", data: img.data, mimeType: img.mimeType });
  return { content: blocks };
}
