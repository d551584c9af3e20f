// The guest agent: the first real process of every machine (under tini). It serves the protocol of protocol.ts
// over HTTP on a unix socket that the driver binds into the machine, and streams on /ws.

// First, before any other module's code runs: out of reach of ptrace and pidfd_getfd from inside the machine.
import "./nodump.ts";
import { createServer } from "node:http";
import { connect } from "node:net";
import type { IncomingMessage, ServerResponse } from "node:http";
import { unlinkSync, existsSync, mkdirSync } from "node:fs";
import { dirname, isAbsolute } from "node:path";
import { AgentFailure } from "./errors.ts";
import { checkSpawnRequest, execOnce, resolveUser, setMachineEnvs } from "./process.ts";
import { lookupUser } from "./users.ts";
import { AGENT_SOCKET_DEFAULT } from "./protocol.ts";
import type { AgentHealth, ExecRequest, FileList } from "./protocol.ts";
import { LIST_DEFAULT_LIMIT, LIST_MAX_DEPTH, LIST_MAX_LIMIT, validAfter } from "./list-pages.ts";
import { sweepScratch } from "./git-scratch.ts";
import { getCompileCacheDir } from "node:module";

// stdout and stderr are a host file on the machine's own disk (runtime.log): a full disk must not end the agent.
process.stdout.on("error", () => undefined);
process.stderr.on("error", () => undefined);

/**
 * Tells one start of the agent from another (PTY sessions are scoped to it). Not a secret and not trusted by anyone,
 * so Math.random's bits do: node:crypto would cost every machine's boot ≈ 3 ms of CPU to load.
 */
const bootId = randomUuidShape();
const startedAt = Date.now();

// What a machine that never uses them must not pay for at boot (their code, Node's fs/promises, their heap): files,
// git runs, code kernels and services load on their first request. Each is loaded once; stopping the agent stops
// only what loaded.
let filesModule: Promise<typeof import("./files.ts")> | undefined;
let gitModule: Promise<typeof import("./git.ts")> | undefined;
let kernelsModule: Promise<typeof import("./kernels/index.ts")> | undefined;
let servicesModule: Promise<typeof import("./services.ts")> | undefined;
const files = () => (filesModule ??= import("./files.ts"));
const git = () => (gitModule ??= import("./git.ts"));
const kernels = () => (kernelsModule ??= import("./kernels/index.ts"));
const services = () => (servicesModule ??= import("./services.ts"));

function randomUuidShape(): string {
  const hex = Array.from({ length: 32 }, () => Math.floor(Math.random() * 16).toString(16)).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-4${hex.slice(13, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

function socketPath(): string {
  const i = process.argv.indexOf("--socket");
  return i > 0 && process.argv[i + 1] ? process.argv[i + 1] : AGENT_SOCKET_DEFAULT;
}

function send(res: ServerResponse, status: number, body: unknown) {
  const text = JSON.stringify(body);
  res.writeHead(status, { "content-type": "application/json", "content-length": Buffer.byteLength(text) });
  res.end(text);
}

/** PUT /files's metadata: a JSON object of string values, or nothing. */
function metadataParam(raw: string | null): Record<string, string> | undefined {
  if (raw === null || raw === "") return undefined;
  let v: unknown;
  try {
    v = JSON.parse(raw);
  } catch {
    throw new AgentFailure("invalid_request", "metadata must be a JSON object of strings");
  }
  if (typeof v !== "object" || v === null || Array.isArray(v) || !Object.values(v).every((x) => typeof x === "string")) {
    throw new AgentFailure("invalid_request", "metadata must be a JSON object of strings");
  }
  return v as Record<string, string>;
}

async function readJson(req: IncomingMessage): Promise<Record<string, any>> {
  const chunks: Buffer[] = [];
  for await (const c of req) chunks.push(c as Buffer);
  if (chunks.length === 0) return {};
  try {
    const v = JSON.parse(Buffer.concat(chunks).toString("utf8"));
    if (typeof v !== "object" || v === null) throw new Error();
    return v;
  } catch {
    throw new AgentFailure("invalid_request", "The body must be a JSON object");
  }
}

function absolutePath(p: unknown, what = "path"): string {
  if (typeof p !== "string" || !isAbsolute(p)) throw new AgentFailure("invalid_request", `${what} must be an absolute path`);
  if (p.includes("\0")) throw new AgentFailure("invalid_request", `${what} must not contain a NUL byte`);
  return p;
}

function ownerOf(name: unknown) {
  return name === undefined || name === null ? undefined : resolveUser(String(name));
}

function octal(mode: unknown): number | undefined {
  if (mode === undefined || mode === null || mode === "") return undefined;
  if (typeof mode !== "string" || !/^[0-7]{3,4}$/.test(mode)) throw new AgentFailure("invalid_request", "mode must be an octal string like 0644");
  return parseInt(mode, 8);
}

async function route(req: IncomingMessage, res: ServerResponse) {
  const url = new URL(req.url ?? "/", "http://agent");
  const q = url.searchParams;
  const key = `${req.method} ${url.pathname}`;
  switch (key) {
    case "GET /health": {
      const body: AgentHealth = { ok: true, boot_id: bootId, pid: process.pid, uptime_ms: Date.now() - startedAt, compile_cache: getCompileCacheDir() ?? null };
      return send(res, 200, body);
    }
    case "PUT /envs": {
      const body = await readJson(req);
      const envs = body.envs ?? {};
      if (typeof envs !== "object" || Object.values(envs).some((v) => typeof v !== "string")) throw new AgentFailure("invalid_request", "envs must map names to strings");
      checkSpawnRequest({ envs });
      setMachineEnvs(envs);
      return send(res, 200, { ok: true });
    }
    case "POST /sessions/reset":
      return send(res, 200, { ended: streams ? (await streams).resetSessions() : 0 });
    case "POST /exec": {
      const body = (await readJson(req)) as ExecRequest;
      if (typeof body.cmd !== "string" || !body.cmd) throw new AgentFailure("invalid_request", "cmd is required");
      // The caller going away (timeout on its side, the machine being destroyed or hibernated) ends the command.
      const gone = new AbortController();
      res.once("close", () => {
        if (!res.writableFinished) gone.abort();
      });
      return send(res, 200, await execOnce(body, gone.signal));
    }
    case "GET /files": {
      const path = absolutePath(q.get("path"));
      const fh = await (await files()).openForDownload(path);
      res.writeHead(200, { "content-type": "application/octet-stream" });
      fh.createReadStream().pipe(res);
      return;
    }
    case "PUT /files": {
      const path = absolutePath(q.get("path"));
      const info = await (await files()).writeFileAtomic(path, req, { mode: octal(q.get("mode")), owner: ownerOf(q.get("user")), metadata: metadataParam(q.get("metadata")) });
      return send(res, 200, info);
    }
    case "POST /files/info": {
      const body = await readJson(req);
      return send(res, 200, await (await files()).fileInfo(absolutePath(body.path)));
    }
    case "GET /files/list": {
      const depth = Number(q.get("depth") ?? 1);
      if (!Number.isInteger(depth) || depth < 1 || depth > LIST_MAX_DEPTH) throw new AgentFailure("invalid_request", `depth must be an integer from 1 to ${LIST_MAX_DEPTH}`);
      const limit = Number(q.get("limit") ?? LIST_DEFAULT_LIMIT);
      if (!Number.isInteger(limit) || limit < 1 || limit > LIST_MAX_LIMIT) throw new AgentFailure("invalid_request", `limit must be an integer from 1 to ${LIST_MAX_LIMIT}`);
      let after: string[] | undefined;
      if (q.get("after") !== null) {
        try {
          after = JSON.parse(q.get("after")!);
        } catch {
          after = undefined;
        }
        if (!validAfter(after, depth)) throw new AgentFailure("invalid_request", "after must be a JSON array of names within the listing's depth");
      }
      const page = await (await files()).listDir(absolutePath(q.get("path")), depth, { limit, after });
      const body: FileList = { entries: page.entries, ...(page.next ? { next_after: page.next } : {}) };
      return send(res, 200, body);
    }
    case "POST /files/mkdir": {
      const body = await readJson(req);
      const path = absolutePath(body.path);
      await (await files()).makeDirs(path, ownerOf(body.user), octal(body.mode) ?? 0o755);
      return send(res, 200, await (await files()).fileInfo(path));
    }
    case "DELETE /files": {
      await (await files()).remove(absolutePath(q.get("path")), q.get("recursive") === "true");
      return send(res, 200, { removed: true });
    }
    case "POST /files/move": {
      const body = await readJson(req);
      return send(res, 200, await (await files()).move(absolutePath(body.src, "src"), absolutePath(body.dest, "dest"), ownerOf(body.user)));
    }
    case "POST /git/run": {
      const body = await readJson(req);
      return send(res, 200, await (await git()).handleGitRun(req, res, body));
    }
  }
  if (url.pathname.startsWith("/code/") && (await (await kernels()).handleCode(req, res, url.pathname, readJson, send))) return;
  if (url.pathname === "/services" || url.pathname.startsWith("/services/")) return serviceRoute(req, res, url);
  if (req.method === "GET" && url.pathname.startsWith("/users/")) {
    const user = lookupUser(decodeURIComponent(url.pathname.slice("/users/".length)));
    if (!user) throw new AgentFailure("not_found", "No such user");
    return send(res, 200, user);
  }
  throw new AgentFailure("not_found", `No agent route ${key}`);
}

async function serviceRoute(req: IncomingMessage, res: ServerResponse, url: URL) {
  const { listServices, restartService, serviceLogs, serviceState, startService, stopService } = await services();
  const [, , rawId, sub] = url.pathname.split("/");
  const id = rawId === undefined ? undefined : decodeURIComponent(rawId);
  if (id === undefined) {
    if (req.method === "POST") return send(res, 200, startService(await readJson(req)));
    if (req.method === "GET") return send(res, 200, { services: listServices() });
  } else if (sub === undefined) {
    if (req.method === "GET") return send(res, 200, serviceState(id));
    if (req.method === "DELETE") return send(res, 200, await stopService(id));
  } else if (sub === "restart" && req.method === "POST") {
    return send(res, 200, await restartService(id, await readJson(req)));
  } else if (sub === "logs" && req.method === "GET") {
    const tail = Number(url.searchParams.get("tail_bytes") ?? 65536);
    if (!Number.isInteger(tail) || tail < 0) throw new AgentFailure("invalid_request", "tail_bytes must be a non-negative integer");
    return send(res, 200, serviceLogs(id, tail));
  }
  throw new AgentFailure("not_found", `No agent route ${req.method} ${url.pathname}`);
}

const server = createServer((req, res) => {
  route(req, res).catch((err: unknown) => {
    const failure = err instanceof AgentFailure ? err : new AgentFailure("internal", (err as Error)?.message ?? "internal error");
    if (res.headersSent) return res.destroy();
    // Drain what is left of the body so the connection can be reused.
    req.resume();
    send(res, failure.status, { code: failure.code, error: failure.message });
  });
});
server.keepAliveTimeout = 60_000;

// Streams (ws, node-pty) load on first use: a machine that never opens a terminal never pays for them at boot.
let streams: Promise<{ wss: import("ws").WebSocketServer; handleStream: typeof import("./streams.ts").handleStream; resetSessions: (all?: boolean) => number }> | undefined;
function loadStreams() {
  streams ??= Promise.all([import("ws"), import("./streams.ts")]).then(([ws, mod]) => ({
    wss: new ws.WebSocketServer({ noServer: true, maxPayload: 32 * 1024 * 1024 }),
    handleStream: mod.handleStream,
    resetSessions: mod.resetSessions,
  }));
  return streams;
}
// Ports inside the machine, reached from the host: `CONNECT 127.0.0.1:<port>` opens a byte stream to a process
// listening on that port in the machine's own network namespace (the deployments proxy rides on this).
server.on("connect", (req, socket, head) => {
  const m = /^(?:127\.0\.0\.1|localhost):(\d{1,5})$/.exec(req.url ?? "");
  const port = m ? Number(m[1]) : 0;
  if (port < 1 || port > 65535) {
    socket.end("HTTP/1.1 400 Bad Request\r\nconnection: close\r\n\r\n");
    return;
  }
  const upstream = connect({ host: "127.0.0.1", port });
  upstream.once("connect", () => {
    socket.write("HTTP/1.1 200 Connection Established\r\n\r\n");
    if (head.length) upstream.write(head);
    upstream.pipe(socket);
    socket.pipe(upstream);
  });
  upstream.once("error", () => socket.end("HTTP/1.1 502 Bad Gateway\r\nconnection: close\r\n\r\n"));
  socket.on("error", () => upstream.destroy());
  upstream.on("close", () => socket.destroy());
});

server.on("upgrade", (req, socket, head) => {
  if (new URL(req.url ?? "/", "http://agent").pathname !== "/ws") return socket.destroy();
  loadStreams().then(
    ({ wss, handleStream }) => wss.handleUpgrade(req, socket, head, (ws) => handleStream(ws)),
    () => socket.destroy(),
  );
});

// Under runc the host hands over an already-listening socket (--listen-fd); otherwise the agent binds a path.
const fdArg = process.argv.indexOf("--listen-fd");
if (fdArg > 0) {
  server.listen({ fd: Number(process.argv[fdArg + 1]) });
} else {
  listenOnPath();
  process.on("SIGUSR2", letGoForCheckpoint);
}

function listenOnPath() {
  const path = socketPath();
  mkdirSync(dirname(path), { recursive: true });
  if (existsSync(path)) unlinkSync(path); // stale from an earlier boot
  // Private from its bind (the umask then decides its mode), not chmod-ed once listening: the host locks the run dir
  // to root as soon as it can connect, which can come before a 'listening' callback runs — a chmod there failed with
  // EACCES under gVisor and ended the agent just after the host saw it up. (A pipe's bind is synchronous in listen.)
  const umask = process.umask(0o177);
  try {
    server.listen(path);
  } finally {
    process.umask(umask);
  }
}

// runsc cannot checkpoint a sandbox holding a socket bound to a host path (host-uds). On SIGUSR2 the agent lets go of
// its listener and every connection; a restored copy cannot be told through a socket it no longer has, so it polls
// for a file the host writes into the bound run dir, for a bounded time, and listens again when it appears.
const RELISTEN_FILE = "relisten";
const RELISTEN_WAIT_MS = 10 * 60_000;
/** The host waits for this agent after a restore: every poll interval is latency of a machine coming back. */
const RELISTEN_POLL_MS = 5;
const connections = new Set<import("node:net").Socket>();
server.on("connection", (socket) => {
  connections.add(socket);
  socket.once("close", () => connections.delete(socket));
});

function letGoForCheckpoint() {
  if (!server.listening) return;
  const trigger = `${dirname(socketPath())}/${RELISTEN_FILE}`;
  server.close();
  for (const socket of connections) socket.destroy();
  const until = Date.now() + RELISTEN_WAIT_MS;
  const poll = setInterval(() => {
    if (!existsSync(trigger) && Date.now() < until) return;
    clearInterval(poll);
    // No way to report a failure from here: the host sees no socket, gives up on this machine and says why.
    server.once("error", () => undefined);
    try {
      listenOnPath();
    } catch {
      /* as above */
    }
  }, RELISTEN_POLL_MS);
}

// Credentials of a git run cut short by an agent crash do not outlive it.
void sweepScratch();

const stop = () => {
  void streams?.then((s) => s.resetSessions(true));
  void kernelsModule?.then((m) => m.stopAllKernels());
  void servicesModule?.then((m) => m.stopAllServices());
  server.close(() => process.exit(0));
  setTimeout(() => process.exit(0), 500).unref();
};
process.on("SIGTERM", stop);
process.on("SIGINT", stop);
