// The guest-agent protocol: what the control plane may ask of the agent inside every machine.
// HTTP/1.1 over the unix socket the driver binds into the machine; streams ride one WebSocket (/ws).
//
// Request/response routes (JSON unless noted; failures answer {code, error} with an HTTP status):
//   GET    /health                       → AgentHealth
//   POST   /exec          ExecRequest    → ExecResult
//   GET    /files?path=                  → raw bytes (application/octet-stream)
//   PUT    /files?path=&mode=&user=      raw bytes → FileInfo
//   POST   /files/info    {path}         → FileInfo (lstat; owner/group names from the machine's files)
//   GET    /files/list?path=&depth=      → {entries: FileInfo[]}
//   POST   /files/mkdir   {path, mode?, user?} → FileInfo
//   DELETE /files?path=&recursive=       → {removed: true}
//   POST   /files/move    {src, dest, user?} → FileInfo
//   GET    /users/:name                  → UserInfo (from the machine's /etc/passwd)
//   GET    /ws            (upgrade)      → stream frames (StreamClientFrame / StreamServerFrame)
//   PUT    /envs          {envs}         → {ok} (the machine's create-time envs, held in the agent's memory)
//   POST   /sessions/reset               → {ended} (a resumed machine is a new execution: PTY sessions end)
//   CONNECT 127.0.0.1:<port>             → a raw byte stream to a port listening inside the machine
// Every path the agent receives is absolute; the control plane resolves relative ones.

export interface AgentHealth {
  ok: true;
  /** Changes every time the agent starts: PTY sessions are scoped to one boot. */
  boot_id: string;
  pid: number;
  uptime_ms: number;
}

export interface ExecRequest {
  /** Shell line run by /bin/sh -c when args is absent; the program when args is given. */
  cmd: string;
  args?: string[];
  cwd?: string;
  envs?: Record<string, string>;
  /** Machine user name; default root. */
  user?: string;
  stdin_base64?: string;
  timeout_ms?: number;
}

export interface ExecResult {
  exit_code: number | null;
  signal: string | null;
  stdout_base64: string;
  stderr_base64: string;
  duration_ms: number;
  timed_out: boolean;
}

export interface FileInfo {
  name: string;
  path: string;
  is_dir: boolean;
  size: number;
  type: "file" | "directory" | "symlink";
  mode: string;
  permissions: string;
  owner: string;
  group: string;
  modified_time: string;
  symlink_target?: string;
}

export interface UserInfo {
  name: string;
  uid: number;
  gid: number;
  home: string;
  shell: string;
}

/** Agent error codes, mapped onto Kiln's catalogue by the host-side client. */
export type AgentErrorCode = "invalid_request" | "not_found" | "conflict" | "forbidden" | "timeout" | "internal";

export interface AgentErrorBody {
  code: AgentErrorCode;
  error: string;
}
