// File tools: read (text, or an image as MCP image content), write and list — /v1/machines/{id}/files….

import { z } from "zod";
import type { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { callJson, errorOf } from "../caller.ts";
import { guarded, seg, textResult, truncate } from "../result.ts";
import type { ToolContext } from "../result.ts";
import { MachineId } from "./machines.ts";

/** Bytes of a file read_file returns; a longer file is cut with a note (run_command reads parts of it). */
export const READ_MAX_BYTES = 256 * 1024;
/** Characters of a text file shown (about a model's comfortable page). */
const READ_MAX_CHARS = 100_000;
/** Entries list_files shows in one answer. */
const LIST_LIMIT = 500;

const Path = z.string().min(1).max(4096).describe("Absolute path, or relative to the machine's working directory (/workspace)");
const User = z.string().min(1).max(64).optional().describe("Act as this user (default the machine's, `user`)");

/** An image a model can look at, told by its first bytes (never by the file name a machine chose). */
function imageType(b: Buffer): string | undefined {
  if (b.length >= 8 && b.readUInt32BE(0) === 0x89504e47) return "image/png";
  if (b.length >= 3 && b[0] === 0xff && b[1] === 0xd8 && b[2] === 0xff) return "image/jpeg";
  if (b.length >= 6 && (b.subarray(0, 6).toString("latin1") === "GIF87a" || b.subarray(0, 6).toString("latin1") === "GIF89a")) return "image/gif";
  if (b.length >= 12 && b.subarray(0, 4).toString("latin1") === "RIFF" && b.subarray(8, 12).toString("latin1") === "WEBP") return "image/webp";
  return undefined;
}

function isText(b: Buffer): boolean {
  if (b.includes(0)) return false;
  try {
    new TextDecoder("utf-8", { fatal: true }).decode(b);
    return true;
  } catch {
    // A multi-byte character cut at the read bound is still text.
    return b.length === READ_MAX_BYTES && isText(b.subarray(0, b.length - 3));
  }
}

interface FileMeta {
  name: string;
  path: string;
  type: string;
  size: number;
  permissions: string;
  owner: string;
  modified_time: string;
  symlink_target?: string;
}

// Made once: a zod schema is compiled on first use, and every request builds a server of these tools.
const readFileInput = z.object({ machine_id: MachineId, path: Path, user: User });

const writeFileInput = z.object({
  machine_id: MachineId,
  path: Path,
  content: z.string().max(32 * 1024 * 1024).describe("The file's content"),
  encoding: z.enum(["utf8", "base64"]).optional().describe("How `content` is encoded (default utf8)"),
  mode: z.string().regex(/^[0-7]{3,4}$/).optional().describe("Permissions in octal, e.g. `0755` for a script"),
  user: User,
});

const listFilesInput = z.object({
  machine_id: MachineId,
  path: Path.optional().describe("Directory (default /workspace)"),
  depth: z.number().int().min(1).max(10).optional().describe("How many levels down (default 1)"),
  cursor: z.string().max(1024).optional().describe("next_cursor of the previous answer"),
  user: User,
});

export function fileTools(server: McpServer, ctx: ToolContext) {
  server.registerTool(
    "read_file",
    {
      title: "Read a file",
      description: `Read a file from a machine. Text comes back as text (at most ${READ_MAX_BYTES / 1024} KiB; longer files are cut with a note), PNG/JPEG/GIF/WebP images as images, other binary files as base64.`,
      inputSchema: readFileInput,
      annotations: { readOnlyHint: true, openWorldHint: false },
    },
    guarded(ctx, async ({ call }, args) => {
      const res = await call("GET", `/v1/machines/${seg(args.machine_id)}/files`, { query: { path: args.path, user: args.user }, maxBytes: READ_MAX_BYTES });
      if (res.status >= 400) throw errorOf(res);
      const cutNote = res.truncated ? `[the file is longer than ${READ_MAX_BYTES} bytes: only its start is shown; read further with run_command, e.g. \`tail -c +${READ_MAX_BYTES + 1} ${args.path} | head -c ${READ_MAX_BYTES}\`]` : "";
      const image = imageType(res.body);
      if (image && !res.truncated) return { content: [{ type: "image", data: res.body.toString("base64"), mimeType: image }] };
      if (isText(res.body)) {
        const text = truncate(res.body.toString("utf8"), READ_MAX_CHARS, "read parts with run_command (`sed -n`)");
        return textResult(cutNote ? `${text.text}\n${cutNote}` : text.text);
      }
      return textResult(`Binary file (${res.body.length} bytes${res.truncated ? " shown" : ""}), base64:\n${res.body.toString("base64")}${cutNote ? `\n${cutNote}` : ""}`);
    }),
  );

  server.registerTool(
    "write_file",
    {
      title: "Write a file",
      description: "Write a file in a machine (replacing it if it exists; parent directories are created). `content` is text, or base64 with encoding `base64` for binary files.",
      inputSchema: writeFileInput,
      annotations: { destructiveHint: true, idempotentHint: true, openWorldHint: false },
    },
    guarded(ctx, async ({ call }, args) => {
      const bytes = Buffer.from(args.content, args.encoding === "base64" ? "base64" : "utf8");
      const meta = await callJson<FileMeta>(call, "PUT", `/v1/machines/${seg(args.machine_id)}/files`, { query: { path: args.path, user: args.user, mode: args.mode }, bytes });
      return textResult(`Wrote ${meta.size} bytes to ${meta.path} (${meta.permissions}, owner ${meta.owner}).`, { file: meta });
    }),
  );

  server.registerTool(
    "list_files",
    {
      title: "List files",
      description: `List a directory in a machine: type, permissions, owner, size and path of each entry (depth 1 by default; at most ${LIST_LIMIT} entries per answer).`,
      inputSchema: listFilesInput,
      annotations: { readOnlyHint: true, openWorldHint: false },
    },
    guarded(ctx, async ({ call }, args) => {
      const page = await callJson<{ entries: FileMeta[]; next_cursor: string | null }>(call, "GET", `/v1/machines/${seg(args.machine_id)}/files/list`, {
        query: { path: args.path ?? "/workspace", depth: args.depth, cursor: args.cursor, user: args.user, limit: LIST_LIMIT },
      });
      const kind = (t: string) => (t === "directory" ? "d" : t === "symlink" ? "l" : "-");
      const lines = page.entries.map((e) => `${kind(e.type)} ${e.permissions} ${e.owner.padEnd(8)} ${String(e.size).padStart(10)}  ${e.path}${e.symlink_target ? ` -> ${e.symlink_target}` : ""}`);
      const text = (lines.length ? lines.join("\n") : "(empty directory)") + (page.next_cursor ? `\n(more entries: call again with cursor ${page.next_cursor})` : "");
      return textResult(text, page);
    }),
  );
}
