// Turns guest-agent failures into Kiln's error catalogue, so a route never sees an agent-specific error.

import { KilnError } from "../errors.ts";
import type { ErrorCode } from "../errors.ts";
import { AgentError } from "../runtime/agent-client.ts";

const AGENT_TO_KILN: Record<string, ErrorCode> = {
  invalid_request: "invalid_request",
  not_found: "not_found",
  conflict: "conflict",
  forbidden: "forbidden",
  timeout: "timeout",
  unavailable: "machine_not_running",
  internal: "internal",
};

export async function viaAgent<T>(fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (err) {
    if (err instanceof AgentError) {
      const code = AGENT_TO_KILN[err.code] ?? "internal";
      throw new KilnError(code, code === "internal" ? "The machine's agent failed" : err.message, { cause: err });
    }
    throw err;
  }
}
