// The control plane's side of the guest-agent protocol: typed calls over the machine's unix socket with a
// keep-alive undici pool, agent errors as AgentError, and the stream socket for exec/PTY.

import { Pool } from "undici";
import type { Dispatcher } from "undici";
import { Readable } from "node:stream";
import { WebSocket } from "ws";
import { request as httpRequest } from "node:http";
import type { Socket } from "node:net";
import type { AgentErrorBody, AgentHealth, ExecRequest, ExecResult, FileInfo, UserInfo } from "../agent/protocol.ts";

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

export function createAgentClient(socketPath: string) {
  const pool = new Pool("http://agent", { socketPath, connections: 16, pipelining: 1, keepAliveTimeout: 30_000, connectTimeout: 2_000 });

  async function raw(method: Dispatcher.HttpMethod, path: string, body?: Body, headers: Record<string, string> = {}): Promise<Dispatcher.ResponseData> {
    let res: Dispatcher.ResponseData;
    try {
      res = await pool.request({ method, path, body, headers, headersTimeout: 0, bodyTimeout: 0 });
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code ?? "";
      throw new AgentError("unavailable", 503, `the machine's agent is unreachable (${code || (err as Error).message})`);
    }
    if (res.statusCode >= 400) {
      const text = await res.body.text();
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

  async function json<T>(method: Dispatcher.HttpMethod, path: string, body?: unknown): Promise<T> {
    const res = await raw(method, path, body === undefined ? undefined : JSON.stringify(body), body === undefined ? {} : { "content-type": "application/json" });
    return (await res.body.json()) as T;
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
    writeFile: async (path: string, body: Buffer | Readable, opts: { mode?: string; user?: string } = {}) =>
      (await raw("PUT", `/files?${q({ path, mode: opts.mode, user: opts.user })}`, body, { "content-type": "application/octet-stream" })).body.json() as Promise<FileInfo>,
    info: (path: string) => json<FileInfo>("POST", "/files/info", { path }),
    list: (path: string, depth: number) => json<{ entries: FileInfo[] }>("GET", `/files/list?${q({ path, depth })}`),
    mkdir: (path: string, opts: { mode?: string; user?: string } = {}) => json<FileInfo>("POST", "/files/mkdir", { path, ...opts }),
    remove: (path: string, recursive: boolean) => json<{ removed: true }>("DELETE", `/files?${q({ path, recursive })}`),
    move: (src: string, dest: string, user?: string) => json<FileInfo>("POST", "/files/move", { src, dest, user }),
    user: (name: string) => json<UserInfo>("GET", `/users/${encodeURIComponent(name)}`),
    /** A byte stream to a TCP port a process listens on inside the machine (HTTP CONNECT through the agent). */
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
        req.once("error", (err) => reject(new AgentError("unavailable", 503, `the machine's agent is unreachable (${(err as NodeJS.ErrnoException).code ?? err.message})`)));
        req.end();
      });
    },
    /** The stream socket (exec/PTY frames); the caller owns its lifecycle. */
    openStream: () => new WebSocket(`ws+unix://${socketPath}:/ws`, { perMessageDeflate: false }),
    close: () => pool.close(),
  };
}

export type AgentClient = ReturnType<typeof createAgentClient>;
