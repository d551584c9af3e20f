// The control plane's side of the guest-agent protocol: typed calls over the machine's unix socket with a
// keep-alive undici pool, agent errors as AgentError, and the stream socket for exec/PTY.

import { Pool } from "undici";
import type { Dispatcher } from "undici";
import { Readable } from "node:stream";
import { WebSocket } from "ws";
import { request as httpRequest } from "node:http";
import type { Socket } from "node:net";
import type { AgentErrorBody, AgentHealth, ExecRequest, ExecResult, FileInfo, FileList, UserInfo } from "../agent/protocol.ts";
import type { CodeContext, CodeContextCreate, CodeExecuteRequest, GitRunRequest, GitRunResult } from "../agent/protocol.ts";
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
  readFileBytes(path: string): Promise<Buffer>;
  writeFile(path: string, body: Buffer | Readable, opts?: { mode?: string; user?: string; metadata?: Record<string, string> }): Promise<FileInfo>;
  info(path: string): Promise<FileInfo>;
  list(path: string, depth: number): Promise<FileList>;
  mkdir(path: string, opts?: { mode?: string; user?: string }): Promise<FileInfo>;
  remove(path: string, recursive: boolean): Promise<{ removed: true }>;
  move(src: string, dest: string, user?: string): Promise<FileInfo>;
  user(name: string): Promise<UserInfo>;
  /** A byte stream to a TCP port a process listens on inside the machine (HTTP CONNECT through the agent). */
  connectPort(port: number): Promise<Socket>;
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
  /** NDJSON frames of one execute; errors come before the first line. Aborting `signal` interrupts it. */
  codeExecute(req: CodeExecuteRequest, signal?: AbortSignal): Promise<Readable>;
  /** Waits for requests in flight, then closes. */
  close(): Promise<void>;
  /** Closes now: requests in flight fail as unavailable (the agent then ends the commands they started). */
  destroy(): Promise<void>;
}

export function createAgentClient(socketPath: string): AgentClient {
  const pool = new Pool("http://agent", { socketPath, connections: 16, pipelining: 1, keepAliveTimeout: 30_000, connectTimeout: 2_000 });

  async function raw(method: Dispatcher.HttpMethod, path: string, body?: Body, headers: Record<string, string> = {}, signal?: AbortSignal): Promise<Dispatcher.ResponseData> {
    let res: Dispatcher.ResponseData;
    try {
      res = await pool.request({ method, path, body, headers, headersTimeout: 0, bodyTimeout: 0, signal });
    } catch (err) {
      throw unavailable(err);
    }
    if (res.statusCode >= 400) {
      const text = await res.body.text().catch((err: unknown) => Promise.reject(unavailable(err)));
      let parsed: Partial<AgentErrorBody> = {};
      try {
        parsed = JSON.parse(text);
      } catch {
        // not JSON: keep the status
      }
      throw new AgentError(parsed.code ?? "internal", res.statusCode, parsed.error ?? `agent answered ${res.statusCode}`);
    }
    return res;
  }

  async function json<T>(method: Dispatcher.HttpMethod, path: string, body?: unknown, signal?: AbortSignal): Promise<T> {
    const res = await raw(method, path, body === undefined ? undefined : JSON.stringify(body), body === undefined ? {} : { "content-type": "application/json" }, signal);
    try {
      return (await res.body.json()) as T;
    } catch (err) {
      throw unavailable(err);
    }
  }

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
    exec: (req: ExecRequest) => json<ExecResult>("POST", "/exec", req),
    async readFile(path: string): Promise<Readable> {
      const res = await raw("GET", `/files?${q({ path })}`);
      return res.body as unknown as Readable;
    },
    async readFileBytes(path: string): Promise<Buffer> {
      const res = await raw("GET", `/files?${q({ path })}`);
      try {
        return Buffer.from(await res.body.arrayBuffer());
      } catch (err) {
        throw unavailable(err);
      }
    },
    async writeFile(path: string, body: Buffer | Readable, opts: { mode?: string; user?: string; metadata?: Record<string, string> } = {}) {
      const metadata = opts.metadata && Object.keys(opts.metadata).length > 0 ? JSON.stringify(opts.metadata) : undefined;
      const res = await raw("PUT", `/files?${q({ path, mode: opts.mode, user: opts.user, metadata })}`, body, { "content-type": "application/octet-stream" });
      try {
        return (await res.body.json()) as FileInfo;
      } catch (err) {
        throw unavailable(err);
      }
    },
    info: (path: string) => json<FileInfo>("POST", "/files/info", { path }),
    list: (path: string, depth: number) => json<FileList>("GET", `/files/list?${q({ path, depth })}`),
    mkdir: (path: string, opts: { mode?: string; user?: string } = {}) => json<FileInfo>("POST", "/files/mkdir", { path, ...opts }),
    remove: (path: string, recursive: boolean) => json<{ removed: true }>("DELETE", `/files?${q({ path, recursive })}`),
    move: (src: string, dest: string, user?: string) => json<FileInfo>("POST", "/files/move", { src, dest, user }),
    user: (name: string) => json<UserInfo>("GET", `/users/${encodeURIComponent(name)}`),
    connectPort(port: number): Promise<Socket> {
      return new Promise((resolve, reject) => {
        const req = httpRequest({ socketPath, method: "CONNECT", path: `127.0.0.1:${port}`, agent: false });
        req.once("connect", (res, socket, head) => {
          if (res.statusCode !== 200) {
            socket.destroy();
            return reject(new AgentError(res.statusCode === 502 ? "not_found" : "invalid_request", res.statusCode ?? 502, `nothing is listening on port ${port} in the machine`));
          }
          if (head.length) socket.unshift(head);
          resolve(socket);
        });
        req.once("error", (err) => reject(unavailable(err)));
        req.end();
      });
    },
    startService: (req: ServiceStartRequest) => json<ServiceState>("POST", "/services", req),
    serviceState: (id: string) => json<ServiceState>("GET", `/services/${encodeURIComponent(id)}`),
    listServices: () => json<{ services: ServiceState[] }>("GET", "/services"),
    restartService: (id: string, envs?: Record<string, string>) => json<ServiceState>("POST", `/services/${encodeURIComponent(id)}/restart`, { envs }),
    stopService: (id: string) => json<ServiceState>("DELETE", `/services/${encodeURIComponent(id)}`),
    serviceLogs: (id: string, tailBytes: number) => json<ServiceLogs>("GET", `/services/${encodeURIComponent(id)}/logs?${q({ tail_bytes: tailBytes })}`),
    openStream: () => new WebSocket(`ws+unix://${socketPath}:/ws`, { perMessageDeflate: false }),
    gitRun: (req: GitRunRequest, signal?: AbortSignal) => json<GitRunResult>("POST", "/git/run", req, signal),
    codeCreate: (spec: CodeContextCreate) => json<CodeContext>("POST", "/code/contexts", spec),
    codeList: () => json<{ contexts: CodeContext[] }>("GET", "/code/contexts"),
    codeRestart: (id: string) => json<CodeContext>("POST", `/code/contexts/${encodeURIComponent(id)}/restart`),
    codeDelete: (id: string) => json<{ deleted: true }>("DELETE", `/code/contexts/${encodeURIComponent(id)}`),
    async codeExecute(req: CodeExecuteRequest, signal?: AbortSignal): Promise<Readable> {
      const res = await raw("POST", "/code/execute", JSON.stringify(req), { "content-type": "application/json" }, signal);
      return res.body as unknown as Readable;
    },
    close: () => pool.close(),
    destroy: () => pool.destroy(),
  };
}
