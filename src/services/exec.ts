// One-shot command execution in a running machine: resolves defaults (cwd, user) the same way files do
// and returns the output as text, with base64 beside it when the bytes are not valid UTF-8.

import { KilnError } from "../errors.ts";
import type { MachineService } from "./machines.ts";
import { viaAgent } from "./agent-errors.ts";
import { resolveMachinePath, needsUserHome, DEFAULT_WORKDIR } from "./paths.ts";

export interface ExecInput {
  cmd: string;
  args?: string[];
  cwd?: string;
  envs?: Record<string, string>;
  user?: string;
  stdin?: string;
  timeout_s?: number;
}

export const EXEC_DEFAULT_TIMEOUT_S = 60;

export function createExecService(machines: MachineService) {
  async function exec(id: string, input: ExecInput) {
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
    );
    if (result.timed_out) {
      throw new KilnError("timeout", `The command did not finish within ${input.timeout_s ?? EXEC_DEFAULT_TIMEOUT_S} s and was killed`);
    }
    const stdout = Buffer.from(result.stdout_base64, "base64");
    const stderr = Buffer.from(result.stderr_base64, "base64");
    return {
      exit_code: result.exit_code,
      signal: result.signal,
      stdout: stdout.toString("utf8"),
      stderr: stderr.toString("utf8"),
      duration_ms: result.duration_ms,
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

export type ExecService = ReturnType<typeof createExecService>;
