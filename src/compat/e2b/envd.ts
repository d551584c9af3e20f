// envd, E2B's in-sandbox daemon, answered by Kiln for every machine: this file builds the kit the protocols share
// (the request's machine, user and home; the Connect registrars) and hands it to one file per protocol:
// process.Process (envd-process.ts), filesystem.Filesystem (envd-filesystem.ts), /files and /health (envd-files.ts).

import { posix } from "node:path";
import type { FastifyInstance, FastifyRequest } from "fastify";
import type { Services } from "../../services/index.ts";
import { userOf } from "../../machines/exec.ts";
import { ConnectFailure, openServerStream, parseEnvelopedRequest, parseJson, sendUnaryError } from "./connect.ts";
import type { ServerStream } from "./connect.ts";
import type { ProcessRegistry } from "./processes.ts";
import { isObj } from "./envd-wire.ts";
import type { EnvdKit } from "./envd-wire.ts";
import { processRpcs } from "./envd-process.ts";
import { filesystemRpcs } from "./envd-filesystem.ts";
import { filesRoutes } from "./envd-files.ts";

/** What Kiln's envd reports: the newest envd whose paths the SDK takes that Kiln serves (see docs/e2b.md). */
export const ENVD_VERSION = "0.6.4";

export interface EnvdDeps {
  services: Services;
  processes: ProcessRegistry;
  /** The sandbox id of an envd request (from E2b-Sandbox-Id or the Host name). */
  sandboxIdOf: (req: FastifyRequest) => string;
  bodyLimit: number;
}

/** The user an `Authorization: Basic base64("user:")` header names, if any. */
export function basicUserOf(req: FastifyRequest): string | undefined {
  const auth = req.headers.authorization;
  if (typeof auth !== "string") return undefined;
  const m = /^Basic\s+([A-Za-z0-9+/=]+)\s*$/i.exec(auth);
  return (m && Buffer.from(m[1], "base64").toString("utf8").split(":")[0]) || undefined;
}

/** The user an envd request acts as: `Authorization: Basic base64("user:")`, else `username`, else the machine's. */
function userNameOf(req: FastifyRequest): string | undefined {
  const basic = basicUserOf(req);
  if (basic) return basic;
  const q = (req.query as Record<string, unknown> | undefined)?.username;
  return typeof q === "string" && q ? q : undefined;
}

export async function envdRoutes(app: FastifyInstance, deps: EnvdDeps) {
  const { services, processes } = deps;
  /** The machine, the acting user and that user's home (the agent client keeps users it found: see agent-client.ts). */
  async function context(req: FastifyRequest) {
    const id = deps.sandboxIdOf(req);
    const { row, agent } = await services.machines.agentOf(id);
    const user = userNameOf(req) ?? row.user;
    return { id, user, home: (await userOf(agent, user)).home };
  }

  /** Relative paths resolve from the user's home, as envd does. */
  const resolvePath = (path: string, home: string) => (path.startsWith("/") ? posix.normalize(path) : posix.resolve(home, path));

  function unary(method: string, fn: (msg: Record<string, unknown>, req: FastifyRequest) => Promise<unknown>) {
    app.post(`/${method}`, { config: { e2b: "envd", auth: "envd-token" as const }, constraints: { e2bEnvd: "envd" } }, async (req, reply) => {
      try {
        const ct = String(req.headers["content-type"] ?? "");
        if (!ct.startsWith("application/json")) throw new ConnectFailure("unimplemented", "only the Connect JSON codec (application/json) is served");
        const msg = isObj(req.body) ? req.body : parseJson(Buffer.isBuffer(req.body) ? req.body : "");
        const out = await fn(msg as Record<string, unknown>, req);
        return reply.code(200).type("application/json").send(out ?? {});
      } catch (err) {
        return sendUnaryError(reply, err);
      }
    });
  }

  function serverStream(method: string, fn: (msg: Record<string, unknown>, req: FastifyRequest, stream: () => ServerStream) => Promise<void>) {
    app.post(`/${method}`, { config: { e2b: "envd", auth: "envd-token" as const }, constraints: { e2bEnvd: "envd" } }, async (req, reply) => {
      const ct = String(req.headers["content-type"] ?? "");
      if (!ct.startsWith("application/connect+json")) return sendUnaryError(reply, new ConnectFailure("unimplemented", "only the Connect JSON codec (application/connect+json) is served"));
      let opened: ReturnType<typeof openServerStream> | undefined;
      const open = () => (opened ??= openServerStream(reply)).stream;
      try {
        const msg = parseEnvelopedRequest(Buffer.isBuffer(req.body) ? req.body : Buffer.alloc(0)) as Record<string, unknown>;
        await fn(msg, req, open);
      } catch (err) {
        // Errors of a stream travel in its end frame, with HTTP 200, as Connect says.
        open().end(err);
      }
      return opened?.response ?? reply;
    });
  }

  const kit: EnvdKit = { app, services, processes, bodyLimit: deps.bodyLimit, sandboxIdOf: deps.sandboxIdOf, context, resolvePath, unary, serverStream };
  processRpcs(kit);
  filesystemRpcs(kit);
  filesRoutes(kit);
}
