// One-shot command execution in a running machine: resolves defaults (cwd, user) the same way files do
// and returns the output as text, with base64 beside it when the bytes are not valid UTF-8.

import { KilnError } from "../errors.ts";
import type { MachineService } from "./service.ts";
import { viaAgent } from "./agent-errors.ts";
import { resolveMachinePath, needsUserHome, DEFAULT_WORKDIR } from "./paths.ts";
import { checkEnvs } from "./input-limits.ts";

/** How exec returns stdout/stderr: UTF-8 text (default) or base64 of the exact bytes. */
export const EXEC_ENCODINGS = ["utf8", "base64"] as const;
export type ExecEncoding = (typeof EXEC_ENCODINGS)[number];

export interface ExecInput {
  cmd: string;
  args?: string[];
  cwd?: string;
  envs?: Record<string, string>;
  user?: string;
  stdin?: string;
  timeout_s?: number;
  encoding?: ExecEncoding;
}

export const EXEC_DEFAULT_TIMEOUT_S = 60;

export interface ExecService {
  exec(id: string, input: ExecInput): Promise<{
    oom_killed?: boolean | undefined;
    encoding?: "base64" | undefined;
    exit_code: number | null;
    signal: string | null;
    stdout: string;
    stderr: string;
    duration_ms: number;
  }>;
}

export function createExecService(machines: MachineService): ExecService {
  async function exec(id: string, input: ExecInput) {
    checkEnvs(input.envs);
    const { row, agent } = await machines.agentOf(id);
    const user = input.user ?? row.user;
    // Default cwd: the machine's cwd, else /workspace; a relative cwd resolves by the same rule as file paths.
    let cwd = row.cwd ?? DEFAULT_WORKDIR;
    if (input.cwd !== undefined) {
      const home = needsUserHome(input.cwd, row.cwd, input.user) ? (await userOf(agent, user)).home : null;
      cwd = resolveMachinePath(input.cwd, { machineCwd: row.cwd, userHome: home });
    }
    const result = await viaAgent(() =>
      agent.exec({
        cmd: input.cmd,
        args: input.args,
        cwd,
        envs: input.envs,
        user,
        stdin_base64: input.stdin === undefined ? undefined : Buffer.from(input.stdin).toString("base64"),
        timeout_ms: (input.timeout_s ?? EXEC_DEFAULT_TIMEOUT_S) * 1000,
      }),
    ).catch((err: unknown) => {
      // Destroy, hibernate and expiry do not wait for a command: they end it, and its caller hears why.
      if (err instanceof KilnError && err.code === "machine_not_running") throw new KilnError("machine_not_running", `Machine ${id} stopped running while the command ran`, { cause: err });
      throw err;
    });
    const base64 = input.encoding === "base64";
    const text = (b64: string) => (base64 ? b64 : Buffer.from(b64, "base64").toString("utf8"));
    if (result.timed_out) {
      // Still a 504, but what the command printed before it was killed is the caller's: it rides in the envelope.
      const seconds = input.timeout_s ?? EXEC_DEFAULT_TIMEOUT_S;
      throw new KilnError("timeout", `The command did not finish within ${seconds} s and was killed; error_detail.details has its output so far`, {
        detail: {
          code: "timeout",
          retryable: false,
          suggested_action: "raise timeout_s, or stream the command over the machine WebSocket (kiln machines exec does)",
          details: {
            timed_out: true,
            exit_code: result.exit_code,
            signal: result.signal,
            stdout: text(result.stdout_base64),
            stderr: text(result.stderr_base64),
            duration_ms: result.duration_ms,
            ...(base64 ? { encoding: "base64" } : {}),
          },
        },
      });
    }
    return {
      exit_code: result.exit_code,
      signal: result.signal,
      stdout: text(result.stdout_base64),
      stderr: text(result.stderr_base64),
      duration_ms: result.duration_ms,
      ...(base64 ? { encoding: "base64" as const } : {}),
      ...(result.oom_killed ? { oom_killed: true } : {}),
    };
  }

  return { exec };
}

/** Looks a user up in the machine's own /etc/passwd; an unknown user is the caller's mistake (400). */
export async function userOf(agent: { user(name: string): Promise<{ home: string; name: string; uid: number; gid: number; shell: string }> }, name: string) {
  return viaAgent(() => agent.user(name)).catch((err: unknown) => {
    if (err instanceof KilnError && err.code === "not_found") throw new KilnError("invalid_request", `No user ${JSON.stringify(name)} in this machine`);
    throw err;
  });
}
