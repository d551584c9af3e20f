// Frames of Kiln's WebSocket routes (DESIGN.md §5): not in the OpenAPI document (it has no words for frames), so
// written here once, as the server sends them.

export type ServerFrame =
  | { type: "exec.started"; request_id?: string; pid: number }
  | { type: "exec.stdout" | "exec.stderr"; pid: number; data_base64: string }
  | { type: "exec.exit"; pid: number; exit_code: number | null; signal: string | null; oom_killed?: true }
  | { type: "pty.started"; request_id?: string; session_id: string; pid: number }
  | { type: "pty.output"; session_id: string; pid: number; offset: number; data_base64: string }
  | { type: "pty.exit"; session_id: string; pid: number; exit_code: number | null; signal: string | null }
  | { type: "pty.reconnected"; request_id?: string; session_id: string; pid: number; offset: number; truncated?: true }
  | { type: "file_watch.started"; request_id?: string; watch_id: string; path: string }
  | { type: "file_unwatch.done"; request_id?: string; watch_id: string }
  | FileEvent
  | ResyncRequired
  | { type: "error"; request_id?: string; code: string; error: string; watch_id?: string };

export interface FileEvent {
  type: "file_event";
  watch_id: string;
  event: "create" | "write" | "remove" | "rename" | "chmod";
  path: string;
  is_dir: boolean;
}

/** Events may have been lost: re-list the watched tree. */
export interface ResyncRequired {
  type: "resync_required";
  watch_id: string;
  path: string;
  reason: string;
}
