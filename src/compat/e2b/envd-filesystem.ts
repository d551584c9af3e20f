// envd's filesystem.Filesystem over Connect: stat, list, mkdir, move, remove, and directory watches (a stream, or a
// polled watcher), each a translation onto Kiln's machine files and the agent's watches.

import type { FastifyRequest } from "fastify";
import type { FileInfo } from "../../agent/protocol.ts";
import { KilnError } from "../../errors.ts";
import { LIST_MAX_LIMIT } from "../../agent/list-pages.ts";
import { ConnectFailure } from "./connect.ts";
import type { ServerStream } from "./connect.ts";
import { createPolledWatchers, envdEventOf } from "./watch.ts";
import { keepaliveEveryS, str, uint } from "./envd-wire.ts";
import type { EnvdKit } from "./envd-wire.ts";

/** The most entries one ListDir answers (envd has no pages; Kiln's files/list has). */
export const E2B_LIST_MAX_ENTRIES = 20_000;

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

export function filesystemRpcs(kit: EnvdKit): void {
  const { services, processes, context, resolvePath, unary, serverStream } = kit;
  const polled = createPolledWatchers(processes);

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
    const everyS = keepaliveEveryS(req);
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
}
