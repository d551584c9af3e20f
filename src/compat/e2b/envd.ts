// envd, E2B's in-sandbox daemon, answered by Kiln for every machine: process.Process and filesystem.Filesystem
// over Connect (JSON), /files and /health — each a translation onto the machine's guest agent via Kiln's services.
// Long for now: the process, filesystem and /files protocols are still one file; splitting them is open (issue 19).

import { posix } from "node:path";
import { Transform } from "node:stream";
import type { Readable } from "node:stream";
import { createGunzip } from "node:zlib";
import type { FastifyInstance, FastifyRequest } from "fastify";
import type { Services } from "../../services/index.ts";
import type { FileInfo } from "../../agent/protocol.ts";
import { userOf } from "../../machines/exec.ts";
import { KilnError } from "../../errors.ts";
import { ConnectFailure, openServerStream, parseEnvelopedRequest, parseJson, sendUnaryError } from "./connect.ts";
import type { ServerStream } from "./connect.ts";
import type { ProcessConfig, ProcessEvent, ProcessRegistry } from "./processes.ts";
import { createPolledWatchers, envdEventOf } from "./watch.ts";
import { LIST_MAX_LIMIT } from "../../agent/list-pages.ts";

/** The most entries one ListDir answers (envd has no pages; Kiln's files/list has). */
export const E2B_LIST_MAX_ENTRIES = 20_000;

/** What Kiln's envd reports: the newest envd whose paths the SDK takes that Kiln serves (see docs/e2b.md). */
export const ENVD_VERSION = "0.6.4";
const KEEPALIVE_DEFAULT_S = 50;

export interface EnvdDeps {
  services: Services;
  processes: ProcessRegistry;
  /** The sandbox id of an envd request (from E2b-Sandbox-Id or the Host name). */
  sandboxIdOf: (req: FastifyRequest) => string;
  bodyLimit: number;
  /** Subscribes to sandboxes becoming usable (created, resumed) through the control plane. */
  onSandboxReady: (fn: (id: string) => void) => void;
}

// ── Request fields ────────────────────────────────────────────────────────────────────────────────────────────

const isObj = (v: unknown): v is Record<string, unknown> => typeof v === "object" && v !== null && !Array.isArray(v);

function str(v: unknown, name: string, opts: { optional?: boolean } = {}): string | undefined {
  if (v === undefined || v === null) {
    if (opts.optional) return undefined;
    throw new ConnectFailure("invalid_argument", `${name} is required`);
  }
  if (typeof v !== "string") throw new ConnectFailure("invalid_argument", `${name} must be a string`);
  return v;
}

function uint(v: unknown, name: string): number | undefined {
  if (v === undefined || v === null) return undefined;
  const n = typeof v === "string" ? Number(v) : v;
  if (typeof n !== "number" || !Number.isInteger(n) || n < 0 || n > 0xffffffff) throw new ConnectFailure("invalid_argument", `${name} must be a non-negative integer`);
  return n;
}

function selectorOf(msg: Record<string, unknown>): { pid?: number; tag?: string } {
  const p = msg.process;
  if (!isObj(p)) throw new ConnectFailure("invalid_argument", "process selector is required");
  if (p.pid !== undefined) return { pid: uint(p.pid, "process.pid") };
  if (p.tag !== undefined) return { tag: str(p.tag, "process.tag") };
  throw new ConnectFailure("invalid_argument", "process selector needs pid or tag");
}

function base64Of(v: unknown, name: string): string {
  if (typeof v !== "string" || !/^[A-Za-z0-9+/_-]*={0,2}$/.test(v)) throw new ConnectFailure("invalid_argument", `${name} must be base64 bytes`);
  return Buffer.from(v, "base64").toString("base64");
}

/** The user an envd request acts as: `Authorization: Basic base64("user:")`, else `username`, else the machine's. */
function userNameOf(req: FastifyRequest): string | undefined {
  const auth = req.headers.authorization;
  if (typeof auth === "string") {
    const m = /^Basic\s+([A-Za-z0-9+/=]+)\s*$/i.exec(auth);
    if (m) {
      const name = Buffer.from(m[1], "base64").toString("utf8").split(":")[0];
      if (name) return name;
    }
  }
  const q = (req.query as Record<string, unknown> | undefined)?.username;
  return typeof q === "string" && q ? q : undefined;
}

// ── Filesystem entries ────────────────────────────────────────────────────────────────────────────────────────

const FILE_TYPES = { file: "FILE_TYPE_FILE", directory: "FILE_TYPE_DIRECTORY", symlink: "FILE_TYPE_SYMLINK" } as const;

/** Kiln's FileInfo as envd's EntryInfo in proto3 JSON (int64 size as a string, Timestamp as RFC 3339). */
function entryOf(f: FileInfo) {
  return {
    name: f.name,
    type: FILE_TYPES[f.type] ?? "FILE_TYPE_UNSPECIFIED",
    path: f.path,
    size: String(f.size),
    mode: parseInt(f.mode, 8) & 0o7777,
    permissions: f.permissions,
    owner: f.owner,
    group: f.group,
    modifiedTime: f.modified_time,
    ...(f.symlink_target !== undefined ? { symlinkTarget: f.symlink_target } : {}),
    ...(f.metadata !== undefined ? { metadata: f.metadata } : {}),
  };
}

// File metadata travels as `X-Metadata-<key>: <value>` upload headers (envd ≥ 0.6.2); keys and values as the SDK
// checks them. Header names are case-insensitive (fetch sends them lowercased), so keys are stored lowercased.
const METADATA_HEADER = /^x-metadata-(.+)$/i;
const METADATA_KEY = /^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$/;
const METADATA_VALUE = /^[\x20-\x7e]*$/;
// Bounded so the metadata, URL-encoded into the agent request's query, stays far within Node's 16 KiB header limit.
const MAX_METADATA_BYTES = 4 * 1024;

function metadataOf(req: FastifyRequest): Record<string, string> | undefined {
  const out: Record<string, string> = {};
  let bytes = 0;
  const raw = req.raw.rawHeaders;
  for (let i = 0; i + 1 < raw.length; i += 2) {
    const m = METADATA_HEADER.exec(raw[i]);
    if (!m) continue;
    const [key, value] = [m[1].toLowerCase(), raw[i + 1]];
    if (!METADATA_KEY.test(key) || !METADATA_VALUE.test(value)) throw new KilnError("invalid_request", `Invalid file metadata ${JSON.stringify(key)}`);
    bytes += key.length + value.length;
    if (bytes > MAX_METADATA_BYTES) throw new KilnError("invalid_request", `File metadata is larger than ${MAX_METADATA_BYTES} bytes`);
    out[key] = value;
  }
  return Object.keys(out).length > 0 ? out : undefined;
}

function limitBytes(body: Readable, limit: number): Readable {
  let seen = 0;
  const guard = new Transform({
    transform(chunk: Buffer, _enc, cb) {
      seen += chunk.length;
      if (seen > limit) return cb(new KilnError("payload_too_large", `The file is larger than the ${limit}-byte limit`));
      cb(null, chunk);
    },
  });
  body.on("error", (err) => guard.destroy(err));
  return body.pipe(guard);
}

export async function envdRoutes(app: FastifyInstance, deps: EnvdDeps) {
  const { services, processes } = deps;
  const homes = new Map<string, string>();
  const polled = createPolledWatchers(processes);

  async function homeOf(id: string, agent: Parameters<typeof userOf>[0], user: string): Promise<string> {
    const key = `${id}\0${user}`;
    let home = homes.get(key);
    if (home === undefined) {
      home = (await userOf(agent, user)).home;
      if (homes.size > 10_000) homes.clear();
      homes.set(key, home);
    }
    return home;
  }

  /** The machine, the acting user and that user's home (cached: homes do not move while a machine runs). */
  async function context(req: FastifyRequest) {
    const id = deps.sandboxIdOf(req);
    const { row, agent } = await services.machines.agentOf(id);
    const user = userNameOf(req) ?? row.user;
    return { id, user, home: await homeOf(id, agent, user) };
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

  /** Streams process events to the client: start first, then everything the process does, keepalives between. */
  function pipeProcess(req: FastifyRequest, stream: ServerStream, machineId: string, attach: (listener: (e: ProcessEvent) => void) => Promise<number>) {
    return new Promise<void>((resolve, reject) => {
      const queued: ProcessEvent[] = [];
      let pid: number | undefined;
      const listener = (e: ProcessEvent) => {
        if (pid === undefined) return void queued.push(e);
        stream.send({ event: e });
        if ("end" in e) stream.end();
      };
      attach(listener).then((p) => {
        pid = p;
        stream.send({ event: { start: { pid: p } } });
        for (const e of queued.splice(0)) listener(e);
        const everyS = Math.max(1, Number(req.headers["keepalive-ping-interval"]) || KEEPALIVE_DEFAULT_S);
        const timer = setInterval(() => stream.send({ event: { keepalive: {} } }), everyS * 1000);
        stream.onClose(() => {
          clearInterval(timer);
          // The client went away (or the process ended): the process goes on, only this listener stops.
          processes.detach(machineId, p, listener);
        });
        resolve();
      }, reject);
    });
  }

  // A sandbox the control plane just made or resumed gets its stream socket and default user's home looked up
  // now, so its first command does not wait for them.
  deps.onSandboxReady((id) => {
    processes.prepare(id);
    services.machines.agentOf(id).then(({ row, agent }) => homeOf(id, agent, row.user)).catch(() => undefined);
  });

  // ── process.Process ────────────────────────────────────────────────────────────────────────────────────────
  serverStream("process.Process/Start", async (msg, req, stream) => {
    const { id, user, home } = await context(req);
    const p = msg.process;
    if (!isObj(p)) throw new ConnectFailure("invalid_argument", "process is required");
    const args = p.args ?? [];
    if (!Array.isArray(args) || !args.every((a) => typeof a === "string")) throw new ConnectFailure("invalid_argument", "process.args must be strings");
    const envs = p.envs ?? {};
    if (!isObj(envs) || !Object.values(envs).every((v) => typeof v === "string")) throw new ConnectFailure("invalid_argument", "process.envs must map names to strings");
    const cwd = str(p.cwd, "process.cwd", { optional: true });
    const config: ProcessConfig = { cmd: str(p.cmd, "process.cmd")!, args: args as string[], envs: envs as Record<string, string>, cwd: cwd ? resolvePath(cwd, home) : home };
    let pty: { cols: number; rows: number } | undefined;
    if (msg.pty !== undefined && msg.pty !== null) {
      const size = isObj(msg.pty) && isObj(msg.pty.size) ? msg.pty.size : {};
      pty = { cols: uint(size.cols, "pty.size.cols") || 80, rows: uint(size.rows, "pty.size.rows") || 24 };
    }
    const tag = str(msg.tag, "tag", { optional: true });
    const s = stream();
    await pipeProcess(req, s, id, (listener) => processes.start(id, { config, user, tag, stdin: msg.stdin === true, pty }, listener));
  });

  serverStream("process.Process/Connect", async (msg, req, stream) => {
    const { id } = await context(req);
    const selector = selectorOf(msg);
    const s = stream();
    await pipeProcess(req, s, id, async (listener) => (await processes.attach(id, selector, listener)).pid);
  });

  unary("process.Process/List", async (_msg, req) => {
    const { id } = await context(req);
    return { processes: await processes.list(id) };
  });

  unary("process.Process/SendInput", async (msg, req) => {
    const { id } = await context(req);
    const input = isObj(msg.input) ? msg.input : {};
    if (input.stdin !== undefined) await processes.input(id, selectorOf(msg), { stdin: base64Of(input.stdin, "input.stdin") });
    else if (input.pty !== undefined) await processes.input(id, selectorOf(msg), { pty: base64Of(input.pty, "input.pty") });
    else throw new ConnectFailure("invalid_argument", "input needs stdin or pty");
    return {};
  });

  unary("process.Process/CloseStdin", async (msg, req) => {
    const { id } = await context(req);
    await processes.closeStdin(id, selectorOf(msg));
    return {};
  });

  unary("process.Process/SendSignal", async (msg, req) => {
    const { id } = await context(req);
    const signal = msg.signal === "SIGNAL_SIGKILL" || msg.signal === 9 ? "SIGKILL" : msg.signal === "SIGNAL_SIGTERM" || msg.signal === 15 ? "SIGTERM" : undefined;
    if (!signal) throw new ConnectFailure("invalid_argument", "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM");
    await processes.signal(id, selectorOf(msg), signal);
    return {};
  });

  unary("process.Process/Update", async (msg, req) => {
    const { id } = await context(req);
    const size = isObj(msg.pty) && isObj(msg.pty.size) ? msg.pty.size : undefined;
    if (!size) return {};
    const cols = uint(size.cols, "pty.size.cols");
    const rows = uint(size.rows, "pty.size.rows");
    if (!cols || !rows || cols > 1000 || rows > 1000) throw new ConnectFailure("invalid_argument", "pty.size needs cols and rows from 1 to 1000");
    await processes.resize(id, selectorOf(msg), { cols, rows });
    return {};
  });

  serverStream("process.Process/StreamInput", async () => {
    throw new ConnectFailure("unimplemented", "StreamInput is a client stream, which the Connect JSON protocol over HTTP/1.1 cannot carry; use SendInput");
  });

  // ── filesystem.Filesystem ──────────────────────────────────────────────────────────────────────────────────
  unary("filesystem.Filesystem/Stat", async (msg, req) => {
    const { id, user, home } = await context(req);
    return { entry: entryOf(await services.files.info(id, { path: resolvePath(str(msg.path, "path")!, home), user })) };
  });

  unary("filesystem.Filesystem/ListDir", async (msg, req) => {
    const { id, user, home } = await context(req);
    const depth = uint(msg.depth, "depth") || 1;
    const path = resolvePath(str(msg.path, "path")!, home);
    const info = await services.files.info(id, { path, user });
    if (info.type !== "directory") throw new ConnectFailure("invalid_argument", `path ${path} is not a directory`);
    // envd answers a whole listing at once: Kiln's pages are gathered here, up to a bound.
    const entries: ReturnType<typeof entryOf>[] = [];
    let cursor: string | undefined;
    do {
      const page = await services.files.list(id, { path, user, depth, limit: LIST_MAX_LIMIT, cursor });
      for (const e of page.entries) entries.push(entryOf(e));
      if (entries.length > E2B_LIST_MAX_ENTRIES) {
        throw new ConnectFailure("resource_exhausted", `${path} holds more than ${E2B_LIST_MAX_ENTRIES} entries at depth ${depth}: list a narrower path or depth, or page through Kiln's files/list`);
      }
      cursor = page.next_cursor ?? undefined;
    } while (cursor);
    return { entries };
  });

  unary("filesystem.Filesystem/MakeDir", async (msg, req) => {
    const { id, user, home } = await context(req);
    const path = resolvePath(str(msg.path, "path")!, home);
    // envd answers AlreadyExists for an existing path (the SDK's makeDir then returns false); Kiln's mkdir is -p.
    const existing = await services.files.info(id, { path, user }).catch((err: unknown) => {
      if (err instanceof KilnError && err.code === "not_found") return undefined;
      throw err;
    });
    if (existing) throw new ConnectFailure(existing.type === "directory" ? "already_exists" : "invalid_argument", `path ${path} already exists`);
    return { entry: entryOf(await services.files.mkdir(id, { path, user })) };
  });

  unary("filesystem.Filesystem/Move", async (msg, req) => {
    const { id, user, home } = await context(req);
    const src = resolvePath(str(msg.source, "source")!, home);
    const dest = resolvePath(str(msg.destination, "destination")!, home);
    return { entry: entryOf(await services.files.move(id, { src, dest, user })) };
  });

  unary("filesystem.Filesystem/Remove", async (msg, req) => {
    const { id, user, home } = await context(req);
    await services.files.remove(id, { path: resolvePath(str(msg.path, "path")!, home), user, recursive: true });
    return {};
  });

  // Watches run in the machine (the agent's fs.watch); the directory is checked as the user first.
  async function watchedDir(req: FastifyRequest, msg: Record<string, unknown>) {
    const { id, user, home } = await context(req);
    const path = resolvePath(str(msg.path, "path")!, home);
    const info = await services.files.info(id, { path, user });
    if (info.type !== "directory") throw new ConnectFailure("invalid_argument", `path ${path} is not a directory`);
    // allowNetworkMounts (envd ≥ 0.6.4) needs nothing more: the agent's fs.watch watches any mounted directory.
    return { id, user, path, recursive: msg.recursive === true, includeEntry: msg.includeEntry === true };
  }

  /** The entry of an event's path, stat'ed now (includeEntry, envd ≥ 0.6.3); a path already gone has none. */
  async function entryAt(id: string, user: string, path: string) {
    const info = await services.files.info(id, { path, user }).catch(() => undefined);
    return info ? entryOf(info) : undefined;
  }

  serverStream("filesystem.Filesystem/WatchDir", async (msg, req, stream) => {
    const { id, user, path, recursive, includeEntry } = await watchedDir(req, msg);
    let s: ServerStream | undefined;
    // With entries, events wait on their stat; a chain keeps them in the order they happened.
    let chain = Promise.resolve();
    const stop = await processes.watch(id, path, recursive, (f) => {
      if (f.type === "end") {
        const error = f.error;
        chain = chain.then(() => s?.end(new ConnectFailure("unavailable", error)));
        return;
      }
      if (f.type !== "file_event") return; // envd has no resync event; see docs/e2b.md
      const e = envdEventOf(path, f);
      if (!e) return;
      if (!includeEntry) {
        chain = chain.then(() => s?.send({ filesystem: e }));
        return;
      }
      const entry = f.event === "remove" ? Promise.resolve(undefined) : entryAt(id, user, f.path);
      chain = chain.then(async () => {
        const info = await entry;
        s?.send({ filesystem: info ? { ...e, entry: info } : e });
      });
    });
    s = stream();
    s.send({ start: {} });
    const everyS = Math.max(1, Number(req.headers["keepalive-ping-interval"]) || KEEPALIVE_DEFAULT_S);
    const timer = setInterval(() => s.send({ keepalive: {} }), everyS * 1000);
    s.onClose(() => {
      clearInterval(timer);
      stop();
    });
  });

  unary("filesystem.Filesystem/CreateWatcher", async (msg, req) => {
    const { id, user, path, recursive, includeEntry } = await watchedDir(req, msg);
    return { watcherId: await polled.create(id, path, recursive, includeEntry ? (p) => entryAt(id, user, p) : undefined) };
  });

  unary("filesystem.Filesystem/GetWatcherEvents", async (msg, req) => {
    const { id } = await context(req);
    return { events: await polled.take(id, str(msg.watcherId, "watcherId")!) };
  });

  unary("filesystem.Filesystem/RemoveWatcher", async (msg, req) => {
    const { id } = await context(req);
    polled.remove(id, str(msg.watcherId, "watcherId")!);
    return {};
  });

  // ── /files and /health (envd's plain HTTP API; errors as {code, message}) ───────────────────────────────────
  const envdRoute = { config: { e2b: "envd", auth: "envd-token" as const }, constraints: { e2bEnvd: "envd" } };

  app.get("/health", envdRoute, async (_req, reply) => reply.code(204).send());

  app.get("/files", envdRoute, async (req, reply) => {
    const { id, user, home } = await context(req);
    const path = (req.query as Record<string, unknown>).path;
    if (typeof path !== "string" || !path) throw new KilnError("invalid_request", "path is required");
    const resolved = resolvePath(path, home);
    const info = await services.files.info(id, { path: resolved, user });
    if (info.type === "directory") throw new KilnError("invalid_request", `path ${resolved} is a directory`);
    const body = await services.files.read(id, { path: resolved, user });
    return reply.type("application/octet-stream").header("content-disposition", `inline; filename=${JSON.stringify(posix.basename(resolved))}`).send(body);
  });

  app.post("/files", envdRoute, async (req, reply) => {
    const { id, user, home } = await context(req);
    const q = (req.query as Record<string, unknown>).path;
    const path = typeof q === "string" && q ? q : undefined;
    const ct = String(req.headers["content-type"] ?? "");
    const metadata = metadataOf(req);
    const written: { name: string; type: "file"; path: string; metadata?: Record<string, string> }[] = [];
    const put = async (target: string, body: Readable | Buffer) => {
      const info = await services.files.write(id, { path: resolvePath(target, home), user, metadata }, body);
      written.push({ name: info.name, type: "file", path: info.path, ...(info.metadata ? { metadata: info.metadata } : {}) });
    };
    if (ct.startsWith("multipart/form-data")) {
      const raw = req.body;
      if (!Buffer.isBuffer(raw)) throw new KilnError("invalid_request", "The multipart body could not be read");
      const form = await new Response(raw, { headers: { "content-type": ct } }).formData().catch(() => {
        throw new KilnError("invalid_request", "The multipart body is malformed");
      });
      const files = form.getAll("file").filter((f): f is File => typeof f !== "string");
      if (files.length === 0) throw new KilnError("invalid_request", "Send the file(s) as multipart parts named file");
      for (const f of files) {
        const target = files.length === 1 && path ? path : f.name;
        if (!target) throw new KilnError("invalid_request", "Each part needs a file name (its path) when no path parameter is given");
        await put(target, Buffer.from(await f.arrayBuffer()));
      }
    } else if (ct.startsWith("application/octet-stream")) {
      if (!path) throw new KilnError("invalid_request", "path is required for an octet-stream upload");
      let body = req.body as Readable | Buffer | undefined;
      if (body === undefined || body === null) throw new KilnError("invalid_request", "Send the file's bytes as the request body");
      if (!Buffer.isBuffer(body)) {
        if (String(req.headers["content-encoding"] ?? "").toLowerCase() === "gzip") body = body.pipe(createGunzip());
        body = limitBytes(body, deps.bodyLimit);
      }
      await put(path, body);
    } else {
      throw new KilnError("unsupported_media_type", "Upload as multipart/form-data or application/octet-stream");
    }
    return reply.code(200).send(written);
  });
}
