// Code-interpreter contexts of a running machine: each is a kernel process held by the guest agent (nothing is
// stored here), made with a ctx_ id, run as the machine's user; executes stream NDJSON frames straight through.

import type { Readable } from "node:stream";
import { KilnError } from "../errors.ts";
import { newId } from "../store/ids.ts";
import type { CodeContext, CodeLanguage } from "../agent/protocol.ts";
import type { MachineService } from "../machines/service.ts";
import { viaAgent } from "../machines/agent-errors.ts";
import { DEFAULT_WORKDIR, resolveMachinePath } from "../machines/paths.ts";
import { ENV_NAME, NO_NUL } from "../machines/input-limits.ts";

export const CODE_LANGUAGES = ["python", "javascript"] as const satisfies readonly CodeLanguage[];
export const CODE_DEFAULT_LANGUAGE: CodeLanguage = "python";
export const CODE_DEFAULT_TIMEOUT_S = 300;
export const CODE_FRAME_TYPES = ["stdout", "stderr", "result", "error", "end"] as const;

/** What the guest agent takes as one execute's envs (src/agent/kernels/index.ts): 64 KiB of names and values in all. */
export const CODE_ENVS_MAX_BYTES = 64 * 1024;

/**
 * An execute's envs are checked here, before the agent sees them: the agent answers its 200 head before it reads
 * them, so a name or size it refuses would end the caller's stream with no answer at all instead of a 400.
 */
function checkCodeEnvs(envs: Record<string, string> | undefined): void {
  if (!envs) return;
  const name = new RegExp(ENV_NAME);
  const noNul = new RegExp(NO_NUL);
  let bytes = 0;
  for (const [k, v] of Object.entries(envs)) {
    if (!name.test(k)) throw new KilnError("invalid_request", `envs: ${JSON.stringify(k.slice(0, 64))} is not a valid environment variable name (letters, digits, _; not starting with a digit)`);
    if (typeof v !== "string" || !noNul.test(v)) throw new KilnError("invalid_request", `envs: the value of ${k} must be a string without NUL bytes`);
    bytes += k.length + v.length;
  }
  if (bytes > CODE_ENVS_MAX_BYTES) throw new KilnError("invalid_request", `envs are larger than ${CODE_ENVS_MAX_BYTES} bytes in all`);
}

const publicView = (c: CodeContext) => ({ id: c.id, language: c.language, cwd: c.cwd });

export interface CodeService {
  create(id: string, input: { language?: CodeLanguage; cwd?: string }): Promise<{ id: string; language: CodeLanguage; cwd: string }>;
  list(id: string): Promise<{
    contexts: { id: string; language: CodeLanguage; cwd: string }[];
  }>;
  restart(id: string, ctxId: string): Promise<{ id: string; language: CodeLanguage; cwd: string }>;
  remove(id: string, ctxId: string): Promise<void>;
  /** NDJSON frames; without context_id the language's default context (made on first use). */
  execute(id: string, input: { code: string; context_id?: string; language?: CodeLanguage; timeout_s?: number; envs?: Record<string, string> }, signal?: AbortSignal): Promise<Readable>;
}

export function createCodeService(machines: MachineService): CodeService {
  async function cwdOf(id: string, cwd: string | undefined) {
    const { row, agent } = await machines.agentOf(id);
    let resolved = row.cwd ?? DEFAULT_WORKDIR;
    if (cwd !== undefined) {
      try {
        resolved = resolveMachinePath(cwd, { machineCwd: row.cwd });
      } catch (err) {
        throw new KilnError("invalid_request", (err as Error).message);
      }
    }
    return { row, agent, cwd: resolved };
  }

  return {
    async create(id: string, input: { language?: CodeLanguage; cwd?: string }) {
      const t = await cwdOf(id, input.cwd);
      const ctx = await viaAgent(() => t.agent.codeCreate({ id: newId("ctx"), language: input.language ?? CODE_DEFAULT_LANGUAGE, cwd: t.cwd, user: t.row.user }));
      return publicView(ctx);
    },

    async list(id: string) {
      const { agent } = await machines.agentOf(id);
      const { contexts } = await viaAgent(() => agent.codeList());
      return { contexts: contexts.map(publicView) };
    },

    async restart(id: string, ctxId: string) {
      const { agent } = await machines.agentOf(id);
      return publicView(await viaAgent(() => agent.codeRestart(ctxId)));
    },

    async remove(id: string, ctxId: string) {
      const { agent } = await machines.agentOf(id);
      await viaAgent(() => agent.codeDelete(ctxId));
    },

    /** NDJSON frames; without context_id the language's default context (made on first use). */
    async execute(id: string, input: { code: string; context_id?: string; language?: CodeLanguage; timeout_s?: number; envs?: Record<string, string> }, signal?: AbortSignal): Promise<Readable> {
      if (input.context_id !== undefined && input.language !== undefined) throw new KilnError("invalid_request", "Give context_id or language, not both (a context has its language)");
      checkCodeEnvs(input.envs);
      const t = await cwdOf(id, undefined);
      const language = input.language ?? CODE_DEFAULT_LANGUAGE;
      return viaAgent(() =>
        t.agent.codeExecute(
          {
            code: input.code,
            context_id: input.context_id,
            language: input.context_id === undefined ? language : undefined,
            default_context: input.context_id === undefined ? { id: newId("ctx"), language, cwd: t.cwd, user: t.row.user } : undefined,
            timeout_ms: (input.timeout_s ?? CODE_DEFAULT_TIMEOUT_S) * 1000,
            ...(input.envs ? { envs: input.envs } : {}),
          },
          signal,
        ),
      );
    },
  };
}
