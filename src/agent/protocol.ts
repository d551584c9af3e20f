// The guest-agent protocol: what the control plane may ask of the agent inside every machine.
// HTTP/1.1 over the unix socket the driver binds into the machine; streams ride one WebSocket (/ws).
//
// Request/response routes (JSON unless noted; failures answer {code, error} with an HTTP status):
//   GET    /health                       → AgentHealth
//   POST   /exec          ExecRequest    → ExecResult
//   GET    /files?path=                  → raw bytes (application/octet-stream)
//   PUT    /files?path=&mode=&user=&metadata= raw bytes → FileInfo (metadata: JSON object of strings)
//   POST   /files/info    {path}         → FileInfo (lstat; owner/group names from the machine's files)
//   GET    /files/list?path=&depth=&limit=&after= → FileList (depth 1 = direct children; a page of `limit`
//                                          entries after the entry at path `after`, a JSON array of names)
//   POST   /files/mkdir   MkdirRequest   → FileInfo (mkdir -p; an existing directory is fine)
//   DELETE /files?path=&recursive=       → {removed: true}
//   POST   /files/move    MoveRequest    → FileInfo of dest
//   GET    /users/:name                  → UserInfo (from the machine's /etc/passwd)
//   GET    /ws            (upgrade)      → stream frames (StreamClientFrame / StreamServerFrame)
//   PUT    /envs          EnvsRequest    → {ok} (the machine's create-time envs, held in the agent's memory)
//   POST   /sessions/reset               → {ended} (a resumed machine is a new execution: PTY sessions end)
//   CONNECT 127.0.0.1:<port>             → a raw byte stream to a port listening inside the machine
//   POST   /services      ServiceStartRequest → ServiceState (starts a supervised process; an existing id answers its state)
//   GET    /services                     → {services: ServiceState[]}
//   GET    /services/:id                 → ServiceState
//   POST   /services/:id/restart  ServiceRestartRequest → ServiceState (envs held in memory for this process only)
//   DELETE /services/:id                 → ServiceState (stopped: SIGTERM, SIGKILL after the grace period)
//   GET    /services/:id/logs?tail_bytes= → ServiceLogs (the recent output ring)
// Every path the agent receives is absolute; the control plane resolves relative ones.

/** Where the agent listens inside the machine unless started with --socket or --listen-fd. */
export const AGENT_SOCKET_DEFAULT = "/run/kiln/agent.sock";

/** The bundle's entry, which machines run (agent/start.ts), and the agent itself beside it (agent/main.ts). */
export const AGENT_ENTRY_FILE = "agent.cjs";
export const AGENT_MAIN_FILE = "main.cjs";
/** The bundle's V8 compile cache, a directory beside its entry (agent/start.ts reads it, agent/bundle.ts makes it). */
export const AGENT_COMPILE_CACHE_DIR = "compile-cache";

export interface AgentHealth {
  ok: true;
  /** Changes every time the agent starts: PTY sessions are scoped to one boot. */
  boot_id: string;
  pid: number;
  uptime_ms: number;
  /**
   * The V8 compile cache the agent's modules load from (the bundle's own, made when the guest runtime was built and
   * read-only in the machine, see agent/bundle.ts), or null when none is enabled (the agent run from source).
   */
  compile_cache?: string | null;
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
  /** Present when the process died of SIGKILL and the machine's memory cgroup counted an OOM kill meanwhile. */
  oom_killed?: true;
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
  /** User metadata written with the file (PUT /files?metadata=<JSON object of strings>). */
  metadata?: Record<string, string>;
}

export interface EnvsRequest {
  /** Replaces the machine's default envs; request envs of exec/PTY still win over these. */
  envs: Record<string, string>;
}

export interface PathRequest {
  path: string;
}

export interface MkdirRequest {
  path: string;
  /** Octal string ("0755") for the directories this call creates. */
  mode?: string;
  /** Owner of the directories this call creates. */
  user?: string;
}

export interface MoveRequest {
  src: string;
  dest: string;
  /** Owner of missing parent directories of dest. */
  user?: string;
}

export interface FileList {
  entries: FileInfo[];
  /** The path (names below the listed directory) to list after for the next page; absent on the last page. */
  next_after?: string[];
}

export interface UserInfo {
  name: string;
  uid: number;
  gid: number;
  home: string;
  shell: string;
}

// ── Supervised services (deployments) ─────────────────────────────────────────────────────────────────────────

/** running: the process is up; backoff: it crashed and waits to be started again; failed: too many crashes in a
 *  row; stopped: stopped on request. */
export type ServiceProcessStatus = "running" | "backoff" | "failed" | "stopped";

export interface ServiceStartRequest {
  /** The control plane's service id (svc_…). */
  id: string;
  /** Shell line run by /bin/sh -c. */
  cmd: string;
  user?: string;
  cwd?: string;
  /** The deployment's envs for this process. */
  envs?: Record<string, string>;
  /** Crashes in a row after which the service ends failed. */
  max_crashes: number;
  /** First delay before a crashed process starts again; doubles per crash in a row up to max_backoff_ms. */
  backoff_ms: number;
  max_backoff_ms: number;
  /** A process that stayed up this long ends a crash streak. */
  stable_ms: number;
}

export interface ServiceRestartRequest {
  /** Request-only envs for the new process and its crash-restarts; held in the agent's memory, never written. */
  envs?: Record<string, string>;
}

export interface ServiceState {
  id: string;
  status: ServiceProcessStatus;
  pid: number | null;
  /** Every start of the process, the first included. */
  starts: number;
  crashes: number;
  consecutive_crashes: number;
  last_exit: { code: number | null; signal: string | null; at: string } | null;
  started_at: string | null;
  failure_reason: string | null;
}

export interface ServiceLogs {
  id: string;
  /** The recent output (stdout and stderr interleaved), base64. */
  data_base64: string;
  /** Bytes written since the service started; more than the ring holds means older output is gone. */
  total_bytes: number;
  truncated: boolean;
}

/** Agent error codes, mapped onto Kiln's catalogue by the host-side client. */
export type AgentErrorCode = "invalid_request" | "not_found" | "conflict" | "forbidden" | "timeout" | "internal";

export interface AgentErrorBody {
  code: AgentErrorCode;
  error: string;
}

// ── Stream frames on /ws: JSON text, one object per WebSocket message ─────────────────────────────────────────
// Client frames name their target by `pid` (exec) or by exactly one of `session_id`/`pid` (PTY). Bytes travel as
// base64 (`data_base64`); `data` is the legacy UTF-8 text form, accepted on input only.
// New features (git, kernels, file watches, port connects) add members to these unions and a case to the router.

export interface ExecStartFrame {
  type: "exec.start";
  request_id?: string;
  cmd: string;
  args?: string[];
  cwd?: string;
  envs?: Record<string, string>;
  user?: string;
  /** Keep stdin open for exec.stdin frames; without it the process reads /dev/null. */
  stdin?: boolean;
  /**
   * Outlive this socket (src/agent/kept.ts): the E2B layer's commands. Default false — a native exec process ends
   * with its socket. A kept process's output frames carry offsets; any later socket reaches it by pid.
   */
  keep?: boolean;
  /** With keep: an opaque label (≤ 1024 characters) given back by kept.list (the E2B layer's tag). */
  label?: string;
}
export interface ExecStdinFrame {
  type: "exec.stdin";
  request_id?: string;
  pid: number;
  data?: string;
  data_base64?: string;
  eof?: boolean;
}
export interface ExecSignalFrame {
  type: "exec.signal";
  request_id?: string;
  pid: number;
  /** "SIGTERM" or "TERM"; delivered to the process group. */
  signal: string;
}
export interface PtyStartFrame {
  type: "pty.start";
  request_id?: string;
  /** Default: the user's login shell with -l. */
  cmd?: string;
  args?: string[];
  cwd?: string;
  envs?: Record<string, string>;
  user?: string;
  cols: number;
  rows: number;
  /** Survive a resume's session reset and be listed by kept.list (the E2B layer's PTYs); default false. */
  keep?: boolean;
  label?: string;
}
type PtyTarget = { session_id: string; pid?: undefined } | { pid: number; session_id?: undefined };
export type PtyInputFrame = { type: "pty.input"; request_id?: string } & PtyTarget & ({ data_base64: string; data?: undefined } | { data: string; data_base64?: undefined });
export type PtyResizeFrame = { type: "pty.resize"; request_id?: string; cols: number; rows: number } & PtyTarget;
export type PtyKillFrame = { type: "pty.kill"; request_id?: string; signal?: string } & PtyTarget;
/** Attaches this socket to the session and replays held output from `offset` (default: the oldest byte held). */
export type PtyReconnectFrame = { type: "pty.reconnect"; request_id?: string; offset?: number } & PtyTarget;

/** File watches (src/agent/watch.ts): the same frame shapes as the volume socket (DESIGN.md §5); paths absolute. */
export type FileWatchFrame = { type: "file_watch"; request_id?: string; path: string; recursive?: boolean };
export type FileUnwatchFrame = { type: "file_unwatch"; request_id?: string; watch_id: string };

/** Attaches this socket to a kept process and replays its held output from `offset` (default: the oldest byte held). */
export type ExecAttachFrame = { type: "exec.attach"; request_id?: string; pid: number; offset?: number };
/** Lists the machine's kept processes and kept PTY sessions (running, and exited ones in their grace). */
export type KeptListFrame = { type: "kept.list"; request_id?: string };

export type StreamClientFrame = ExecAttachFrame | KeptListFrame | ExecStartFrame | ExecStdinFrame | ExecSignalFrame | PtyStartFrame | PtyInputFrame | PtyResizeFrame | PtyKillFrame | PtyReconnectFrame | FileWatchFrame | FileUnwatchFrame;

export interface ExecStartedFrame {
  type: "exec.started";
  request_id?: string;
  pid: number;
}
export interface ExecOutputFrame {
  type: "exec.stdout" | "exec.stderr";
  pid: number;
  /** Kept processes only: byte offset of this chunk in the process's whole output (stdout and stderr together). */
  offset?: number;
  data_base64: string;
}
export interface ExecAttachedFrame {
  type: "exec.attached";
  request_id?: string;
  pid: number;
  /** Offset the replay starts at (later than asked when those bytes left the process's 1 MiB ring). */
  offset: number;
  truncated?: true;
}
export interface KeptInfo {
  kind: "exec" | "pty";
  pid: number;
  session_id?: string;
  cmd?: string;
  args?: string[];
  cwd?: string;
  envs?: Record<string, string>;
  user?: string;
  label?: string;
  running: boolean;
}
export type KeptListedFrame = { type: "kept.listed"; request_id?: string; processes: KeptInfo[] };
export interface ExecExitFrame {
  type: "exec.exit";
  pid: number;
  exit_code: number | null;
  /** Signal name ("SIGKILL") when the process died of one. */
  signal: string | null;
  /** Present when the kernel's OOM killer ended the process (as far as the machine's memory cgroup tells). */
  oom_killed?: true;
}
export interface PtyStartedFrame {
  type: "pty.started";
  request_id?: string;
  session_id: string;
  pid: number;
}
export interface PtyOutputFrame {
  type: "pty.output";
  session_id: string;
  pid: number;
  /** Byte offset of this chunk in the session's whole output stream. */
  offset: number;
  data_base64: string;
}
export interface PtyExitFrame {
  type: "pty.exit";
  session_id: string;
  pid: number;
  exit_code: number | null;
  signal: string | null;
}
export interface PtyReconnectedFrame {
  type: "pty.reconnected";
  request_id?: string;
  session_id: string;
  pid: number;
  /** Offset the replay starts at (later than asked when those bytes are gone). */
  offset: number;
  /** Present when bytes before the requested offset have left the session's 1 MiB ring buffer. */
  truncated?: true;
}
export interface StreamErrorFrame {
  type: "error";
  request_id?: string;
  code: AgentErrorCode;
  error: string;
  /** Set when a file watch ended on its own. */
  watch_id?: string;
}
export type FileWatchStartedFrame = { type: "file_watch.started"; request_id?: string; watch_id: string; path: string };
export type FileUnwatchDoneFrame = { type: "file_unwatch.done"; request_id?: string; watch_id: string };
export type FileEventFrame = { type: "file_event"; watch_id: string; event: "create" | "write" | "remove" | "rename" | "chmod"; path: string; is_dir: boolean };
/** Events of the watch may have been lost: `slow_client` (dropped while the socket was backed up), `too_many_directories` (new ones past the bound go unwatched). */
export type ResyncRequiredFrame = { type: "resync_required"; watch_id: string; path: string; reason: "slow_client" | "too_many_directories" };

export type StreamServerFrame = ExecAttachedFrame | KeptListedFrame | ExecStartedFrame | ExecOutputFrame | ExecExitFrame | PtyStartedFrame | PtyOutputFrame | PtyExitFrame | PtyReconnectedFrame | StreamErrorFrame | FileWatchStartedFrame | FileUnwatchDoneFrame | FileEventFrame | ResyncRequiredFrame;

// ── Git (src/agent/git.ts) ───────────────────────────────────────────────────────────────────────────────────────
//   POST   /git/run       GitRunRequest  → GitRunResult (git's outputs scrubbed of every credential)
// The control plane builds the argv (user refs after --end-of-options); the agent owns the credentials: a 0700
// scratch dir per run with an askpass helper and key files, removed when the run ends. A closed request cancels.

export interface GitAuth {
  kind: "https" | "ssh";
  username?: string;
  password?: string;
  private_key?: string;
  passphrase?: string;
}

export interface GitRunRequest {
  /** Arguments after `git` (the agent adds `-c protocol.ext.allow=never` and an empty credential.helper). */
  args: string[];
  cwd?: string;
  user?: string;
  auth?: GitAuth;
  /** The remote's own URLs: an HTTPS password is offered only to their scheme+host(+port), never to a redirect's target. */
  credential_urls?: string[];
  envs?: Record<string, string>;
  stdin?: string;
  timeout_ms?: number;
}

export interface GitRunResult {
  exit_code: number | null;
  signal: string | null;
  stdout: string;
  stderr: string;
  timed_out: boolean;
  cancelled: boolean;
  duration_ms: number;
}

// ── Code interpreter (src/agent/kernels/*) ──────────────────────────────────────────────────────────────────────
//   POST   /code/contexts               CodeContextCreate → CodeContext (the kernel is up when this answers)
//   GET    /code/contexts                                 → {contexts: CodeContext[]}
//   POST   /code/contexts/:id/restart                     → CodeContext (a fresh kernel, state gone)
//   DELETE /code/contexts/:id                             → {deleted: true} (kernel process gone) | 404
//   POST   /code/execute                CodeExecuteRequest → application/x-ndjson of CodeFrame, one per line;
//          errors found before the first line (unknown context, bad language) answer a JSON error instead.
//   POST   /code/adopt                  CodeAdoptRequest  → {kept} (a hot-pool machine handed to a create: its
//          prestarted default Python context is kept when its user and cwd are the create's, and then takes the
//          create's envs into its os.environ; otherwise it is stopped and the first execute starts a fresh one)
// An execute past timeout_ms, or whose request closes, is interrupted; the kernel stays usable.

export type CodeLanguage = "python" | "javascript";

export interface CodeContextCreate {
  /** Chosen by the control plane (ctx_…). */
  id: string;
  language: CodeLanguage;
  cwd: string;
  user: string;
}

export interface CodeContext {
  id: string;
  language: CodeLanguage;
  cwd: string;
  user: string;
  /** Pid of the kernel process itself (the Python kernel, or the Node kernel). */
  kernel_pid: number | null;
  created_at: string;
}

export interface CodeExecuteRequest {
  code: string;
  context_id?: string;
  /** Without context_id: the default context of this language, made on first use with these fields. */
  language?: CodeLanguage;
  default_context?: CodeContextCreate;
  timeout_ms?: number;
  /** Environment variables for this execute only (set before it, put back after it). */
  envs?: Record<string, string>;
}

export interface CodeAdoptRequest {
  user: string;
  cwd: string;
  /** The machine's envs (template's and create's): set in the kept kernel's os.environ, as a fresh kernel would see them. */
  envs: Record<string, string>;
}

export type CodeFrame =
  | { type: "stdout" | "stderr"; text: string }
  | { type: "result"; data: Record<string, string>; is_main_result: boolean; execution_count?: number | null }
  | { type: "error"; name: string; value: string; traceback: string }
  | { type: "end"; context_id: string; execution_count: number | null; duration_ms: number; status: "ok" | "error" | "interrupted" | "timeout" };
