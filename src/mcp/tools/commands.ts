// run_command: POST /v1/machines/{id}/exec — stdout, stderr and the exit code, long output cut with a note.

import { z } from "zod";
import type { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { callJson } from "../caller.ts";
import { guarded, seg, textResult, truncate } from "../result.ts";
import type { ToolContext } from "../result.ts";
import { MachineId, withoutUndefined } from "./machines.ts";

/** Characters of stdout (and of stderr) a model is shown; the middle of longer output is cut. */
export const COMMAND_OUTPUT_MAX_CHARS = 16_000;
const CUT_HINT = "redirect the output to a file and read parts of it (e.g. `cmd > /tmp/out; sed -n 1,200p /tmp/out`)";

interface ExecResult {
  exit_code: number | null;
  signal: string | null;
  stdout: string;
  stderr: string;
  duration_ms: number;
  oom_killed?: boolean;
}

// Made once: a zod schema is compiled on first use, and every request builds a server of these tools.
const runCommandInput = z.object({
  machine_id: MachineId,
  command: z.string().min(1).max(131_072).describe("Shell command line, e.g. `ls -la /workspace && python3 main.py`"),
  cwd: z.string().min(1).max(4096).optional().describe("Working directory (default: the machine's, /workspace)"),
  user: z.string().min(1).max(64).optional().describe("Run as this user (default `user`; `root` for package installs)"),
  envs: z.record(z.string(), z.string()).optional().describe("Extra environment variables"),
  stdin: z.string().max(16 * 1024 * 1024).optional().describe("Text given to the command on stdin"),
  timeout_s: z.number().int().min(1).max(3600).optional().describe("Kill the command (and its children) after this many seconds (default 60)"),
});

export function commandTools(server: McpServer, ctx: ToolContext) {
  server.registerTool(
    "run_command",
    {
      title: "Run a command",
      description:
        "Run a shell command line (/bin/sh -c) in a machine and wait for it to end. Returns its exit code, stdout and stderr " +
        `(each cut to ${COMMAND_OUTPUT_MAX_CHARS} characters, keeping the start and the end). A non-zero exit code is a normal answer, not a failure.`,
      inputSchema: runCommandInput,
      annotations: { openWorldHint: true },
    },
    guarded(ctx, async ({ call, direct }, args) => {
      const { machine_id, command, ...rest } = args;
      const input = { cmd: command, timeout_s: 60, ...withoutUndefined(rest) };
      const r: ExecResult = direct ? await direct.exec(machine_id, input) : await callJson<ExecResult>(call, "POST", `/v1/machines/${seg(machine_id)}/exec`, { json: input });
      const stdout = truncate(r.stdout, COMMAND_OUTPUT_MAX_CHARS, CUT_HINT);
      const stderr = truncate(r.stderr, COMMAND_OUTPUT_MAX_CHARS, CUT_HINT);
      const ended = r.exit_code !== null ? `exit code ${r.exit_code}` : `killed by ${r.signal ?? "a signal"}${r.oom_killed ? " (out of memory)" : ""}`;
      const text = [`${ended} (${Math.round(r.duration_ms)} ms)`, stdout.text ? `--- stdout ---\n${stdout.text}` : "(no stdout)", stderr.text ? `--- stderr ---\n${stderr.text}` : ""].filter(Boolean).join("\n");
      return textResult(text, {
        exit_code: r.exit_code,
        signal: r.signal,
        stdout: stdout.text,
        stderr: stderr.text,
        duration_ms: r.duration_ms,
        truncated: stdout.truncated || stderr.truncated,
        ...(r.oom_killed ? { oom_killed: true } : {}),
      });
    }),
  );
}
