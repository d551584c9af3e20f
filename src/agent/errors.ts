// Errors the agent answers with: a protocol code and an HTTP status, plus the mapping from Node's fs errors.

import type { AgentErrorCode } from "./protocol.ts";

const STATUS: Record<AgentErrorCode, number> = { invalid_request: 400, forbidden: 403, not_found: 404, conflict: 409, timeout: 504, internal: 500 };

export class AgentFailure extends Error {
  readonly code: AgentErrorCode;
  readonly status: number;
  constructor(code: AgentErrorCode, message: string) {
    super(message);
    this.code = code;
    this.status = STATUS[code];
  }
}

/** Turns an fs error into a failure that names the path, so the client sees why. */
export function fsFailure(err: unknown, path: string): AgentFailure {
  const code = (err as NodeJS.ErrnoException)?.code;
  switch (code) {
    case "ENOENT":
      return new AgentFailure("not_found", `No such file or directory: ${path}`);
    case "ENOTDIR":
      return new AgentFailure("invalid_request", `A parent of ${path} is not a directory`);
    case "EISDIR":
      return new AgentFailure("invalid_request", `${path} is a directory`);
    case "EEXIST":
      return new AgentFailure("conflict", `${path} already exists`);
    case "ENOTEMPTY":
      return new AgentFailure("invalid_request", `${path} is a non-empty directory (use recursive)`);
    case "EACCES":
    case "EPERM":
    case "EROFS":
      return new AgentFailure("forbidden", `Permission denied: ${path}`);
    case "EXDEV":
      return new AgentFailure("invalid_request", `Cannot move across file systems: ${path}`);
    default:
      return err instanceof AgentFailure ? err : new AgentFailure("internal", `${code ?? "error"} on ${path}`);
  }
}
