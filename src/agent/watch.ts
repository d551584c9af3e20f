// File watches of one agent stream socket, inside the machine (so writes made through its overlay root are seen):
// one non-recursive fs.watch (an inotify watch) per directory, new directories added as they appear, as
// `inotifywait -r` does. (Node's own recursive mode on Linux polls files with watchFile: writes arrive late.)
// fs.watch's "rename"/"change" become create/remove and write/chmod by a stat of the path.

import { watch, lstatSync, readdirSync } from "node:fs";
import type { Dirent, FSWatcher } from "node:fs";
import { isAbsolute, join, posix } from "node:path";
import { randomUUID } from "node:crypto";
import { AgentFailure } from "./errors.ts";
import { UPLOAD_PREFIX } from "./files.ts";
import type { StreamServerFrame } from "./protocol.ts";

export const MAX_WATCHES_PER_SOCKET = 64;
/** Directories one recursive watch covers (one inotify watch each); a bigger tree is refused at start. */
export const MAX_DIRS_PER_WATCH = 8192;
/** Stat results kept per watch to tell a chmod from a write; beyond this the oldest are forgotten. */
const MAX_REMEMBERED = 10_000;
/** Unsent bytes on the socket above which events are dropped (and a resync_required follows once it drains). */
const DROP_ABOVE = 4 * 1024 * 1024;

interface Watch {
  id: string;
  path: string;
  recursive: boolean;
  /** One inotify watch (non-recursive fs.watch) per directory of the watched tree. */
  dirs: Map<string, FSWatcher>;
  /** path → what this watch last saw of it. */
  seen: Map<string, Seen>;
  dropped: boolean;
  capped: boolean;
  /** Directory → whether the upload just renamed out of its temp file replaces a file (see onChange). */
  uploads: Map<string, boolean>;
}

export interface WatchSink {
  send(frame: StreamServerFrame): void;
  backlog(): number;
}

/** What a watch keeps of a path: its change times tell a write (mtime and ctime move) from a chmod (ctime alone). */
interface Seen {
  mode: bigint;
  mtime: bigint;
  ctime: bigint;
  isDir: boolean;
}

function statOf(path: string): Seen | undefined {
  try {
    const s = lstatSync(path, { bigint: true });
    return { mode: s.mode, mtime: s.mtimeNs, ctime: s.ctimeNs, isDir: s.isDirectory() };
  } catch {
    return undefined;
  }
}

/**
 * What a "change" of a path was. fs.watch says "change" for inotify's modify and attrib alike, and a busy machine
 * may handle the event after later ones happened, so the stat decides: an mtime that moved is a write; a ctime that
 * moved past the last write, or a mode that moved, is an attribute change (chmod, chown, xattrs: envd's CHMOD).
 * Nothing new is a write whose effect an earlier event already showed.
 */
function changeOf(before: Seen | undefined, now: Seen): ("write" | "chmod")[] {
  const attribAfterWrite = now.ctime > now.mtime;
  if (!before) return [attribAfterWrite ? "chmod" : "write"];
  const wrote = now.mtime !== before.mtime;
  const attrib = now.mode !== before.mode || (now.ctime !== before.ctime && (attribAfterWrite || !wrote));
  if (wrote && attrib) return ["write", "chmod"];
  return [attrib ? "chmod" : "write"];
}

/**
 * The one walk of the watch code: entries below `dir`, breadth first, at most `limit` of those `pick` keeps (it
 * answers undefined to skip one). Only directories (not symlinks) are descended into, and only kept ones.
 */
function walkBelow<T>(dir: string, limit: number, pick: (path: string, e: Dirent) => T | undefined): T[] {
  const out: T[] = [];
  const queue = [dir];
  while (queue.length && out.length < limit) {
    const d = queue.shift()!;
    let entries: Dirent[];
    try {
      entries = readdirSync(d, { withFileTypes: true });
    } catch {
      continue;
    }
    for (const e of entries) {
      const p = join(d, e.name);
      const kept = pick(p, e);
      if (kept === undefined) continue;
      out.push(kept);
      if (e.isDirectory()) queue.push(p);
      if (out.length >= limit) break;
    }
  }
  return out;
}

/** Directories (not symlinks) below `dir`, breadth first, at most `limit`. */
function subdirs(dir: string, limit: number): string[] {
  return walkBelow(dir, limit, (p, e) => (e.isDirectory() ? p : undefined));
}

/** Everything below `dir` (a directory that just appeared), breadth first, at most `limit` entries. */
function entriesBelow(dir: string, limit: number): { path: string; isDir: boolean }[] {
  return walkBelow(dir, limit, (p, e) => (e.name.startsWith(UPLOAD_PREFIX) ? undefined : { path: p, isDir: e.isDirectory() }));
}

export function createWatches(sink: WatchSink) {
  const watches = new Map<string, Watch>();

  function remember(w: Watch, path: string, s: Seen) {
    w.seen.delete(path);
    w.seen.set(path, s);
    if (w.seen.size > MAX_REMEMBERED) w.seen.delete(w.seen.keys().next().value!);
  }

  function emit(w: Watch, frame: StreamServerFrame & { type: "file_event" | "resync_required" }) {
    if (sink.backlog() > DROP_ABOVE) {
      w.dropped = true;
      return;
    }
    if (w.dropped) {
      w.dropped = false;
      sink.send({ type: "resync_required", watch_id: w.id, path: w.path, reason: "slow_client" });
    }
    sink.send(frame);
  }

  /** `starting`: a failure is the start's answer; later (a directory appearing) it must not throw out of an event. */
  function watchDir(w: Watch, dir: string, starting = false) {
    if (w.dirs.has(dir)) return;
    if (w.dirs.size >= MAX_DIRS_PER_WATCH) {
      // Past the bound, new directories are not watched: their events are lost, which the client is told once.
      if (!w.capped) emit(w, { type: "resync_required", watch_id: w.id, path: w.path, reason: "too_many_directories" });
      w.capped = true;
      return;
    }
    let watcher: FSWatcher;
    try {
      watcher = watch(dir, { persistent: false });
    } catch (err) {
      const gone = (err as NodeJS.ErrnoException).code === "ENOENT" && dir !== w.path;
      if (starting) {
        if (gone) return; // a subdirectory removed while the tree was walked
        throw err;
      }
      // Gone again before its watch was set (ENOENT), or out of inotify watches (ENOSPC): its events are lost.
      if (!gone) emit(w, { type: "resync_required", watch_id: w.id, path: w.path, reason: "too_many_directories" });
      return;
    }
    w.dirs.set(dir, watcher);
    watcher.on("change", (kind, name) => onChange(w, dir, kind, name));
    // inotify failed under this directory (it went away, a watch limit): drop it; a removed root ends the watch.
    watcher.on("error", () => unwatchTree(w, dir));
  }

  function unwatchTree(w: Watch, dir: string) {
    for (const [d, watcher] of w.dirs) {
      if (d === dir || d.startsWith(dir + "/")) {
        watcher.close();
        w.dirs.delete(d);
      }
    }
    if (dir === w.path && watches.delete(w.id)) {
      closeWatch(w);
      sink.send({ type: "error", code: "not_found", error: `The watched directory ${w.path} is gone; the watch ended`, watch_id: w.id });
    }
  }

  function onChange(w: Watch, dir: string, kind: string, name: string | Buffer | null) {
    if (!watches.has(w.id)) return;
    // An event of the directory itself (deleted or moved away): its own entry in the parent reports it.
    // (inotify's delete-self comes with the directory's own name: any event of a directory that is gone is that.)
    if (name === null || !statOf(dir)) return void (statOf(dir) ? undefined : unwatchTree(w, dir));
    const path = posix.normalize(join(dir, name.toString()));
    const now = statOf(path);
    // An upload through the files API in flight is not shown: its rename into place is the event, a write when it
    // replaces a file, a create and a write when the file is new (as envd reports a written file).
    if (posix.basename(path).startsWith(UPLOAD_PREFIX)) {
      if (kind === "rename" && !now) w.uploads.set(dir, path.charAt(dir.length + 1 + UPLOAD_PREFIX.length) === "r");
      return;
    }
    const upload = kind === "rename" && now ? w.uploads.get(dir) : undefined;
    if (upload !== undefined) {
      w.uploads.delete(dir);
      remember(w, path, now!);
      if (!upload) emit(w, { type: "file_event", watch_id: w.id, event: "create", path, is_dir: false });
      return emit(w, { type: "file_event", watch_id: w.id, event: "write", path, is_dir: false });
    }
    const before = w.seen.get(path);
    let event: "create" | "write" | "remove" | "chmod";
    if (kind === "rename") event = now ? "create" : "remove";
    else if (!now) event = "remove";
    else {
      const [first, second] = changeOf(before, now);
      if (second) emit(w, { type: "file_event", watch_id: w.id, event: first, path, is_dir: now.isDir });
      event = second ?? first;
    }
    // A create handled after an attribute change of the new entry: its own event follows, so keep the ctime of the
    // last write for it to move from (a chmod right after `echo > f` is still a chmod).
    if (now) remember(w, path, event === "create" && now.ctime > now.mtime ? { ...now, ctime: now.mtime } : now);
    else w.seen.delete(path);
    emit(w, { type: "file_event", watch_id: w.id, event, path, is_dir: now ? now.isDir : (before?.isDir ?? w.dirs.has(path)) });
    if (!w.recursive) return;
    if (event === "remove") unwatchTree(w, path);
    else if (event === "create" && now?.isDir) {
      // A new directory: watch it and what it already holds; entries made before its watch are reported as created.
      watchDir(w, path);
      for (const e of entriesBelow(path, MAX_DIRS_PER_WATCH)) {
        emit(w, { type: "file_event", watch_id: w.id, event: "create", path: e.path, is_dir: e.isDir });
        if (e.isDir) watchDir(w, e.path);
      }
    }
  }

  function closeWatch(w: Watch) {
    for (const watcher of w.dirs.values()) watcher.close();
    w.dirs.clear();
  }

  return {
    start(f: Record<string, unknown>) {
      const path = f.path;
      if (typeof path !== "string" || !isAbsolute(path) || path.includes("\0")) throw new AgentFailure("invalid_request", "file_watch needs an absolute path");
      if (f.recursive !== undefined && typeof f.recursive !== "boolean") throw new AgentFailure("invalid_request", "file_watch recursive must be a boolean");
      if (watches.size >= MAX_WATCHES_PER_SOCKET) throw new AgentFailure("invalid_request", `At most ${MAX_WATCHES_PER_SOCKET} watches per socket`);
      const s = statOf(path);
      if (!s) throw new AgentFailure("not_found", `No such directory: ${path}`);
      if (!s.isDir) throw new AgentFailure("invalid_request", `Not a directory: ${path}`);
      const normalized = posix.normalize(path);
      const w: Watch = { id: `wch_${randomUUID().replaceAll("-", "").slice(0, 20)}`, path: normalized, recursive: f.recursive === true, dirs: new Map(), seen: new Map(), dropped: false, capped: false, uploads: new Map() };
      try {
        watchDir(w, normalized, true);
        if (w.recursive) {
          const below = subdirs(normalized, MAX_DIRS_PER_WATCH);
          if (below.length >= MAX_DIRS_PER_WATCH) throw new AgentFailure("conflict", `${path} holds more than ${MAX_DIRS_PER_WATCH} directories; watch a smaller tree`);
          for (const d of below) watchDir(w, d, true);
        }
      } catch (err) {
        closeWatch(w);
        if (err instanceof AgentFailure) throw err;
        const code = (err as NodeJS.ErrnoException).code;
        throw new AgentFailure(code === "ENOSPC" ? "conflict" : "internal", `Cannot watch ${path}: ${code ?? (err as Error).message}`);
      }
      watches.set(w.id, w);
      sink.send({ type: "file_watch.started", ...(typeof f.request_id === "string" ? { request_id: f.request_id } : {}), watch_id: w.id, path: w.path });
    },
    stop(f: Record<string, unknown>) {
      const w = typeof f.watch_id === "string" ? watches.get(f.watch_id) : undefined;
      if (!w) throw new AgentFailure("not_found", `No watch ${String(f.watch_id)} on this socket`);
      watches.delete(w.id);
      closeWatch(w);
      sink.send({ type: "file_unwatch.done", ...(typeof f.request_id === "string" ? { request_id: f.request_id } : {}), watch_id: w.id });
    },
    closeAll() {
      for (const w of watches.values()) closeWatch(w);
      watches.clear();
    },
  };
}
