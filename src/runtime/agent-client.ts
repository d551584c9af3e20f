// The control plane's side of the guest-agent protocol: typed calls over the machine's unix socket with a
// keep-alive undici pool, agent errors as AgentError, and the stream socket for exec/PTY.
//
// Whatever answers on that socket runs inside the machine, so nothing it says is trusted: every answer has a
// deadline for its headers, a deadline (buffered answers) or an idle bound (streamed ones) for its body, and a
// size cap; stream frames have a size cap too. An impostor's endless or giant answer ends as a 504 or a 500, never
// as a hung request or a grown server (docs/security/machines.md).

import { Pool } from "undici";
import type { Dispatcher } from "undici";
import { Readable } from "node:stream";
import { WebSocket } from "ws";
import { request as httpRequest } from "node:http";
import type { Socket } from "node:net";
import type { AgentErrorBody, AgentHealth, ExecRequest, ExecResult, FileInfo, FileList, UserInfo } from "../agent/protocol.ts";
import type { CodeAdoptRequest, CodeContext, CodeContextCreate, CodeExecuteRequest, GitRunRequest, GitRunResult } from "../agent/protocol.ts";
import type { ServiceLogs, ServiceStartRequest, ServiceState } from "../agent/protocol.ts";

export class AgentError extends Error {
  readonly code: AgentErrorBody["code"] | "unavailable";
  readonly status: number;
  constructor(code: AgentError["code"], status: number, message: string) {
    super(message);
    this.name = "AgentError";
    this.code = code;
    this.status = status;
  }
}

type Body = string | Buffer | Readable | undefined;

const MiB = 1024 * 1024;

/** The bounds on what an agent answers (see the file's head). */
export const AGENT_ANSWER_LIMITS = {
  /** Opening a connection to the agent's socket. */
  connectMs: 2_000,
  /** Headers of a call that answers at once (everything but commands, git runs and kernels). */
  headersMs: 30_000,
  /** The whole body of a buffered answer, from its headers on (a unix socket moves 48 MiB in well under a second). */
  bodyMs: 15_000,
  /** Silence allowed inside a streamed answer (a file's bytes). */
  idleMs: 60_000,
  /** Beyond a command's own timeout: the agent answers right after it (kill, reap grace) or the call fails. */
  commandGraceMs: 15_000,
  /** A command sent without a timeout of its own is bounded here. */
  defaultCommandMs: 10 * 60_000,
  /** A kernel's start (the agent gives up at 60 s). */
  kernelStartMs: 90_000,
  /** The agent's answer to an upload, once the upload ended. */
  afterUploadMs: 60_000,
  /** Most answers: metadata, states, users. */
  maxAnswerBytes: 4 * MiB,
  /** Exec and git results (two outputs of up to 16 MiB, base64), file list pages. */
  maxLargeAnswerBytes: 48 * MiB,
  /** An error body. */
  maxErrorBytes: 64 * 1024,
  /** One frame on the stream socket (the agent sends output in chunks of 64 KiB). */
  maxFrameBytes: 4 * MiB,
} as const;

interface CallBounds {
  /** Until the answer's headers, from when the request went out on a connection (time queued for one is not counted). */
  headersMs: number;
  /** Buffered answers: the most bytes read (within bodyMs of the headers); streamed answers have none. */
  maxBytes?: number;
  /** An upload: the answer is bounded (afterUploadMs) from the moment the request body has been sent instead. */
  afterUpload?: Readable;
  /** Streamed answers: silence allowed between chunks (default idleMs). */
  idleMs?: number;
  /** Streamed answers: the whole stream, from its headers, when it has such a bound. */
  streamMs?: number;
}

/** The agent's own default for an execute without a timeout (agent/kernels). */
const CODE_EXECUTE_DEFAULT_MS = 300_000;
/** Users one agent client keeps (a machine has a handful; the bound only stops a caller naming many). */
const MAX_KNOWN_USERS = 64;

/** One call's deadline: started (and restarted) at each stage, firing an abort the request listens to. */
function deadline(signal: AbortSignal | undefined) {
  const ctrl = new AbortController();
  let timer: NodeJS.Timeout | undefined;
  let expiredAfter = 0;
  return {
    signal: signal ? AbortSignal.any([signal, ctrl.signal]) : ctrl.signal,
    /** The bound that fired, if one did (0: none). */
    expiredAfter: () => expiredAfter,
    start(ms: number) {
      clearTimeout(timer);
      // Unref'd: a bound must never be what keeps the process alive (an upload that ended after its answer).
      timer = setTimeout(() => {
        expiredAfter = ms;
        ctrl.abort(new Error("deadline"));
      }, ms).unref();
    },
    clear: () => clearTimeout(timer),
  };
}

function tooSlow(ms: number): AgentError {
  return new AgentError("timeout", 504, `the machine's agent did not answer within ${Math.round(ms / 1000)} s`);
}

/** Reads a whole body, failing (and destroying it) past `max` bytes. */
async function readCapped(body: Dispatcher.ResponseData["body"], max: number): Promise<Buffer> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of body) {
    size += (chunk as Buffer).length;
    if (size > max) {
      body.destroy();
      throw new AgentError("internal", 502, `the machine's agent answered more than ${max} bytes`);
    }
    chunks.push(chunk as Buffer);
  }
  return Buffer.concat(chunks);
}

/** The agent's socket is gone or went away mid-answer: the machine is not running (or its agent died). */
function unavailable(err: unknown): AgentError {
  if (err instanceof AgentError) return err;
  const code = (err as NodeJS.ErrnoException)?.code ?? "";
  return new AgentError("unavailable", 503, `the machine's agent is unreachable (${code || (err as Error)?.message || "closed"})`);
}

export interface AgentClient {
  readonly socketPath: string;
  health(): Promise<AgentHealth>;
  /** The machine's default envs for everything started later (PUT /envs). */
  setEnvs(envs: Record<string, string>): Promise<{ ok: true }>;
  /** Ends every PTY session (a resumed machine is a new execution). */
  resetSessions(): Promise<{ ended: number }>;
  exec(req: ExecRequest): Promise<ExecResult>;
  /** The file's bytes as a stream; errors (404, 400 for a directory) come before the first byte. */
  readFile(path: string): Promise<Readable>;
  /** The file's bytes, whole; an answer past `maxBytes` (default maxLargeAnswerBytes) fails. */
  readFileBytes(path: string, maxBytes?: number): Promise<Buffer>;
  writeFile(path: string, body: Buffer | Readable, opts?: { mode?: string; user?: string; metadata?: Record<string, string> }): Promise<FileInfo>;
  info(path: string): Promise<FileInfo>;
  /** One page of a directory listing (agent/list-pages.ts): `limit` entries after the entry at path `after`. */
  list(path: string, depth: number, page?: { limit?: number; after?: string[] }): Promise<FileList>;
  mkdir(path: string, opts?: { mode?: string; user?: string }): Promise<FileInfo>;
  remove(path: string, recursive: boolean): Promise<{ removed: true }>;
  move(src: string, dest: string, user?: string): Promise<FileInfo>;
  user(name: string): Promise<UserInfo>;
  /** A byte stream to a TCP port a process listens on inside the machine (HTTP CONNECT through the agent), within `timeoutMs` (at most headersMs). */
  connectPort(port: number, timeoutMs?: number): Promise<Socket>;
  /** Starts a supervised service process (an id the agent already runs answers its state). */
  startService(req: ServiceStartRequest): Promise<ServiceState>;
  serviceState(id: string): Promise<ServiceState>;
  listServices(): Promise<{ services: ServiceState[] }>;
  /** Restarts the process; `envs` live only in the agent's memory, for that process and its crash-restarts. */
  restartService(id: string, envs?: Record<string, string>): Promise<ServiceState>;
  stopService(id: string): Promise<ServiceState>;
  serviceLogs(id: string, tailBytes: number): Promise<ServiceLogs>;
  /** The stream socket (StreamClientFrame/StreamServerFrame as JSON text); the caller owns its lifecycle. */
  openStream(): WebSocket;
  /** `git <args>` with per-run credentials; aborting `signal` cancels the run inside the machine. */
  gitRun(req: GitRunRequest, signal?: AbortSignal): Promise<GitRunResult>;
  codeCreate(spec: CodeContextCreate): Promise<CodeContext>;
  codeList(): Promise<{ contexts: CodeContext[] }>;
  codeRestart(id: string): Promise<CodeContext>;
  codeDelete(id: string): Promise<{ deleted: true }>;
  /** A hot-pool machine's prestarted default kernel, kept for this create's user/cwd (with its envs) or stopped. */
  codeAdopt(req: CodeAdoptRequest): Promise<{ kept: boolean }>;
  /** NDJSON frames of one execute; errors come before the first line. Aborting `signal` interrupts it. */
  codeExecute(req: CodeExecuteRequest, signal?: AbortSignal): Promise<Readable>;
  /** Waits for requests in flight, then closes. */
  close(): Promise<void>;
  /** Closes now: requests in flight fail as unavailable (the agent then ends the commands they started). */
  destroy(): Promise<void>;
}

export function createAgentClient(socketPath: string): AgentClient {
  const L = AGENT_ANSWER_LIMITS;
  const users = new Map<string, Promise<UserInfo>>();
  const pool = new Pool("http://agent", { socketPath, connections: 16, pipelining: 1, keepAliveTimeout: 30_000, connectTimeout: L.connectMs, headersTimeout: L.headersMs, bodyTimeout: L.idleMs });

  /**
   * One call with its bounds. A buffered answer (`maxBytes`) is read here, whole, within bodyMs of its headers; a
   * streamed one is handed back with undici's idle bound (and `streamMs`, if any) on it. Agent failures (status ≥ 400)
   * become AgentError.
   */
  async function call(method: Dispatcher.HttpMethod, path: string, bounds: CallBounds, body?: Body, headers: Record<string, string> = {}, signal?: AbortSignal): Promise<{ res: Dispatcher.ResponseData; bytes?: Buffer }> {
    const limit = deadline(signal);
    // An upload may take as long as its sender: the agent's answer is bounded from the moment it has all of it.
    if (bounds.afterUpload) bounds.afterUpload.once("end", () => limit.start(L.afterUploadMs));
    const failed = (err: unknown) => (limit.expiredAfter() ? tooSlow(limit.expiredAfter()) : unavailable(err));
    let res: Dispatcher.ResponseData;
    try {
      res = await pool.request({ method, path, body, headers, headersTimeout: bounds.afterUpload ? 0 : bounds.headersMs, bodyTimeout: bounds.idleMs ?? L.idleMs, signal: limit.signal });
    } catch (err) {
      limit.clear();
      if ((err as { code?: string })?.code === "UND_ERR_HEADERS_TIMEOUT") throw tooSlow(bounds.headersMs);
      throw failed(err);
    }
    const streamed = bounds.maxBytes === undefined && res.statusCode < 400;
    try {
      if (streamed) {
        // From here on the idle bound (and the reader, and streamMs) decide.
        if (bounds.streamMs) {
          limit.start(bounds.streamMs);
          res.body.once("close", () => limit.clear());
        } else limit.clear();
        return { res };
      }
      limit.start(L.bodyMs);
      if (res.statusCode >= 400) {
        const text = (await readCapped(res.body, L.maxErrorBytes)).toString("utf8");
        let parsed: Partial<AgentErrorBody> = {};
        try {
          parsed = JSON.parse(text);
        } catch {
          // not JSON: keep the status
        }
        const code = typeof parsed.code === "string" ? parsed.code : "internal";
        throw new AgentError(code, res.statusCode, typeof parsed.error === "string" ? parsed.error : `agent answered ${res.statusCode}`);
      }
      return { res, bytes: await readCapped(res.body, bounds.maxBytes!) };
    } catch (err) {
      if (err instanceof AgentError) throw err;
      throw failed(err);
    } finally {
      if (!streamed) limit.clear();
    }
  }

  async function json<T>(method: Dispatcher.HttpMethod, path: string, body?: unknown, opts: { signal?: AbortSignal; headersMs?: number; maxBytes?: number } = {}): Promise<T> {
    const bounds: CallBounds = { headersMs: opts.headersMs ?? L.headersMs, maxBytes: opts.maxBytes ?? L.maxAnswerBytes };
    const text = body === undefined ? undefined : JSON.stringify(body);
    const { bytes } = await call(method, path, bounds, text, text === undefined ? {} : { "content-type": "application/json" }, opts.signal);
    try {
      return JSON.parse(bytes!.toString("utf8")) as T;
    } catch {
      throw new AgentError("internal", 502, "the machine's agent answered something that is not JSON");
    }
  }

  /** A command's call: its answer comes within its own timeout plus the grace the agent needs to end it and answer. */
  const commandBounds = (timeoutMs: number | undefined, extraMs = 0) => ({
    headersMs: (timeoutMs && timeoutMs > 0 ? timeoutMs : L.defaultCommandMs) + extraMs + L.commandGraceMs,
    maxBytes: L.maxLargeAnswerBytes,
  });

  const q = (params: Record<string, string | number | boolean | undefined>) => {
    const s = new URLSearchParams();
    for (const [k, v] of Object.entries(params)) if (v !== undefined) s.set(k, String(v));
    return s.toString();
  };

  return {
    socketPath,
    health: () => json<AgentHealth>("GET", "/health"),
    setEnvs: (envs: Record<string, string>) => json<{ ok: true }>("PUT", "/envs", { envs }),
    resetSessions: () => json<{ ended: number }>("POST", "/sessions/reset"),
    exec: (req: ExecRequest) => json<ExecResult>("POST", "/exec", req, commandBounds(req.timeout_ms)),
    async readFile(path: string): Promise<Readable> {
      const { res } = await call("GET", `/files?${q({ path })}`, { headersMs: L.headersMs });
      return res.body as unknown as Readable;
    },
    async readFileBytes(path: string, maxBytes: number = L.maxLargeAnswerBytes): Promise<Buffer> {
      return (await call("GET", `/files?${q({ path })}`, { headersMs: L.headersMs, maxBytes })).bytes!;
    },
    async writeFile(path: string, body: Buffer | Readable, opts: { mode?: string; user?: string; metadata?: Record<string, string> } = {}) {
      const metadata = opts.metadata && Object.keys(opts.metadata).length > 0 ? JSON.stringify(opts.metadata) : undefined;
      const upload = Buffer.isBuffer(body) ? undefined : body;
      const bounds: CallBounds = { headersMs: L.headersMs, afterUpload: upload, maxBytes: L.maxAnswerBytes };
      const { bytes } = await call("PUT", `/files?${q({ path, mode: opts.mode, user: opts.user, metadata })}`, bounds, body, { "content-type": "application/octet-stream" });
      try {
        return JSON.parse(bytes!.toString("utf8")) as FileInfo;
      } catch {
        throw new AgentError("internal", 502, "the machine's agent answered something that is not JSON");
      }
    },
    info: (path: string) => json<FileInfo>("POST", "/files/info", { path }),
    list: (path: string, depth: number, page: { limit?: number; after?: string[] } = {}) =>
      json<FileList>("GET", `/files/list?${q({ path, depth, limit: page.limit, after: page.after && JSON.stringify(page.after) })}`, undefined, { maxBytes: L.maxLargeAnswerBytes }),
    mkdir: (path: string, opts: { mode?: string; user?: string } = {}) => json<FileInfo>("POST", "/files/mkdir", { path, ...opts }),
    remove: (path: string, recursive: boolean) => json<{ removed: true }>("DELETE", `/files?${q({ path, recursive })}`),
    move: (src: string, dest: string, user?: string) => json<FileInfo>("POST", "/files/move", { src, dest, user }),
    user(name: string): Promise<UserInfo> {
      // A user found is kept for this client's life (one machine's execution): the create's own check fills it, so
      // the first command, file call or E2B request does not ask again. A miss is asked again (a user made later).
      const known = users.get(name);
      if (known) return known;
      const found = json<UserInfo>("GET", `/users/${encodeURIComponent(name)}`);
      if (users.size >= MAX_KNOWN_USERS) users.clear();
      users.set(name, found);
      found.catch(() => users.delete(name));
      return found;
    },
    connectPort(port: number, timeoutMs: number = L.headersMs): Promise<Socket> {
      const bound = Math.min(timeoutMs, L.headersMs);
      return new Promise((resolve, reject) => {
        const req = httpRequest({ socketPath, method: "CONNECT", path: `127.0.0.1:${port}`, agent: false });
        // Only the answer to CONNECT is bounded here: the byte stream after it lives as long as its users want.
        const timer = setTimeout(() => req.destroy(tooSlow(bound)), bound).unref();
        req.once("close", () => clearTimeout(timer));
        req.once("connect", (res, socket, head) => {
          clearTimeout(timer);
          if (res.statusCode !== 200) {
            socket.destroy();
            return reject(new AgentError(res.statusCode === 502 ? "not_found" : "invalid_request", res.statusCode ?? 502, `nothing is listening on port ${port} in the machine`));
          }
          if (head.length) socket.unshift(head);
          resolve(socket);
        });
        req.once("error", (err) => reject(err instanceof AgentError ? err : unavailable(err)));
        req.end();
      });
    },
    startService: (req: ServiceStartRequest) => json<ServiceState>("POST", "/services", req),
    serviceState: (id: string) => json<ServiceState>("GET", `/services/${encodeURIComponent(id)}`),
    listServices: () => json<{ services: ServiceState[] }>("GET", "/services"),
    restartService: (id: string, envs?: Record<string, string>) => json<ServiceState>("POST", `/services/${encodeURIComponent(id)}/restart`, { envs }),
    stopService: (id: string) => json<ServiceState>("DELETE", `/services/${encodeURIComponent(id)}`),
    serviceLogs: (id: string, tailBytes: number) => json<ServiceLogs>("GET", `/services/${encodeURIComponent(id)}/logs?${q({ tail_bytes: tailBytes })}`),
    openStream: () => new WebSocket(`ws+unix://${socketPath}:/ws`, { perMessageDeflate: false, maxPayload: L.maxFrameBytes, handshakeTimeout: L.headersMs }),
    gitRun: (req: GitRunRequest, signal?: AbortSignal) => json<GitRunResult>("POST", "/git/run", req, { ...commandBounds(req.timeout_ms), signal }),
    codeCreate: (spec: CodeContextCreate) => json<CodeContext>("POST", "/code/contexts", spec, { headersMs: L.kernelStartMs }),
    codeList: () => json<{ contexts: CodeContext[] }>("GET", "/code/contexts"),
    codeRestart: (id: string) => json<CodeContext>("POST", `/code/contexts/${encodeURIComponent(id)}/restart`, undefined, { headersMs: L.kernelStartMs }),
    codeDelete: (id: string) => json<{ deleted: true }>("DELETE", `/code/contexts/${encodeURIComponent(id)}`),
    codeAdopt: (req: CodeAdoptRequest) => json<{ kept: boolean }>("POST", "/code/adopt", req),
    async codeExecute(req: CodeExecuteRequest, signal?: AbortSignal): Promise<Readable> {
      // The frames stream through to the caller (bounded memory). Headers may wait for a default context's kernel to
      // start; the whole execute is bounded by its timeout, and silence inside it may last as long (a computation
      // that prints nothing).
      const run = (req.timeout_ms && req.timeout_ms > 0 ? req.timeout_ms : CODE_EXECUTE_DEFAULT_MS) + L.commandGraceMs;
      const bounds: CallBounds = { headersMs: L.kernelStartMs + L.commandGraceMs, idleMs: run, streamMs: run };
      const { res } = await call("POST", "/code/execute", bounds, JSON.stringify(req), { "content-type": "application/json" }, signal);
      return res.body as unknown as Readable;
    },
    close: () => pool.close(),
    destroy: () => pool.destroy(),
  };
}
