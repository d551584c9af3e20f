// envd's filesystem.Filesystem over Connect: stat, list, mkdir, move, remove, and directory watches (a stream, or a
// polled watcher), each a translation onto Kiln's machine files and the agent's watches.

import { posix } from "node:path";
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

const S_IFMT = 0o170000;
const S_TYPES: Record<number, string> = { 0o100000: "FILE_TYPE_FILE", 0o040000: "FILE_TYPE_DIRECTORY" };
// Go's os.FileMode letters, in the order FileMode.String writes them, each with the stat bits that set it.
const GO_MODE_LETTERS: [string, (st: number) => boolean][] = [
  ["d", (st) => (st & S_IFMT) === 0o040000],
  ["L", (st) => (st & S_IFMT) === 0o120000],
  ["D", (st) => (st & S_IFMT) === 0o060000 || (st & S_IFMT) === 0o020000],
  ["p", (st) => (st & S_IFMT) === 0o010000],
  ["S", (st) => (st & S_IFMT) === 0o140000],
  ["u", (st) => (st & 0o4000) !== 0],
  ["g", (st) => (st & 0o2000) !== 0],
  ["c", (st) => (st & S_IFMT) === 0o020000],
  ["t", (st) => (st & 0o1000) !== 0],
];

/** A stat mode as envd shows it: Go's FileMode.String of the lstat (`-rw-r--r--`, `drwxr-xr-x`, `Lrwxrwxrwx`). */
export function goModeString(st: number): string {
  const kind = GO_MODE_LETTERS.filter(([, has]) => has(st)).map(([c]) => c).join("") || "-";
  const rwx = [..."rwxrwxrwx"].map((c, i) => (st & (1 << (8 - i)) ? c : "-")).join("");
  return kind + rwx;
}

/**
 * Kiln's FileInfo as envd's EntryInfo in proto3 JSON (int64 size as a string, Timestamp as RFC 3339), as envd builds
 * it: `permissions` from the lstat; for a symlink, `symlinkTarget` is the fully resolved absolute path and `type` and
 * `mode` are its target's (a link that does not resolve: its own path, type unspecified).
 */
function entryOf(f: FileInfo, link?: { target: string; info?: FileInfo }) {
  const st = parseInt(f.mode, 8);
  const shown = link ? link.info : f;
  const shownSt = shown ? parseInt(shown.mode, 8) : 0;
  return {
    name: f.name,
    type: (shown && S_TYPES[shownSt & S_IFMT]) ?? "FILE_TYPE_UNSPECIFIED",
    path: f.path,
    size: String(f.size),
    mode: shownSt & 0o777,
    permissions: goModeString(st),
    owner: f.owner,
    group: f.group,
    modifiedTime: f.modified_time,
    ...(link ? { symlinkTarget: link.target } : {}),
    ...(f.metadata !== undefined ? { metadata: f.metadata } : {}),
  };
}

/** The most links one symlink's resolution follows (Linux's own limit, MAXSYMLINKS). */
const MAX_LINK_HOPS = 40;

export function filesystemRpcs(kit: EnvdKit): void {
  const { services, processes, context, resolvePath, unary, serverStream } = kit;
  const polled = createPolledWatchers(processes);

  /**
   * An entry as envd describes it, its symlink followed as the user sees it: link by link (each target read in the
   * machine, relative ones from their link's directory) until a non-link; a dangling or looping chain resolves to
   * the link's own path, as Go's EvalSymlinks failing does in envd.
   */
  async function describe(id: string, user: string, f: FileInfo) {
    if (f.type !== "symlink") return entryOf(f);
    let path = f.path;
    let at: FileInfo | undefined = f;
    for (let hops = 0; at?.type === "symlink" && hops < MAX_LINK_HOPS; hops++) {
      path = posix.resolve(posix.dirname(path), at.symlink_target ?? "");
      at = await services.files.info(id, { path, user }).catch(() => undefined);
    }
    return at && at.type !== "symlink" ? entryOf(f, { target: path, info: at }) : entryOf(f, { target: f.path });
  }

  unary("filesystem.Filesystem/Stat", async (msg, req) => {
    const { id, user, home } = await context(req);
    return { entry: await describe(id, user, await services.files.info(id, { path: resolvePath(str(msg.path, "path")!, home), user })) };
  });

  unary("filesystem.Filesystem/ListDir", async (msg, req) => {
    const { id, user, home } = await context(req);
    const depth = uint(msg.depth, "depth") || 1;
    const path = resolvePath(str(msg.path, "path")!, home);
    const info = await services.files.info(id, { path, user });
    if (info.type !== "directory") throw new ConnectFailure("invalid_argument", `path ${path} is not a directory`);
    // envd answers a whole listing at once: Kiln's pages are gathered here, up to a bound.
    const entries: Awaited<ReturnType<typeof describe>>[] = [];
    let cursor: string | undefined;
    do {
      const page = await services.files.list(id, { path, user, depth, limit: LIST_MAX_LIMIT, cursor });
      for (const e of page.entries) entries.push(await describe(id, user, e));
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
    return { entry: await describe(id, user, await services.files.mkdir(id, { path, user })) };
  });

  unary("filesystem.Filesystem/Move", async (msg, req) => {
    const { id, user, home } = await context(req);
    const src = resolvePath(str(msg.source, "source")!, home);
    const dest = resolvePath(str(msg.destination, "destination")!, home);
    return { entry: await describe(id, user, await services.files.move(id, { src, dest, user })) };
  });

  unary("filesystem.Filesystem/Remove", async (msg, req) => {
    const { id, user, home } = await context(req);
    // envd removes with os.RemoveAll: a path that is not there is already removed, not an error.
    await services.files.remove(id, { path: resolvePath(str(msg.path, "path")!, home), user, recursive: true }).catch((err: unknown) => {
      if (!(err instanceof KilnError && err.code === "not_found")) throw err;
    });
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
    return info ? describe(id, user, info) : undefined;
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
