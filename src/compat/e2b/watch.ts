// envd's file watches (filesystem.Filesystem/WatchDir and the CreateWatcher/GetWatcherEvents/RemoveWatcher trio)
// as translations of the agent's file watches: the agent's event kinds become envd's EventType, paths become names
// relative to the watched directory.

import { posix } from "node:path";
import { randomUUID } from "node:crypto";
import type { FileEventFrame } from "../../agent/protocol.ts";
import type { ProcessRegistry } from "./processes.ts";
import { ConnectFailure } from "./connect.ts";

/** envd's FilesystemEvent in proto3 JSON. */
export interface EnvdFsEvent {
  name: string;
  type: string;
  /** The entry's info at event time, when the watch asked for it (includeEntry) and the path still exists. */
  entry?: unknown;
}

const EVENT_TYPE: Record<FileEventFrame["event"], string> = {
  create: "EVENT_TYPE_CREATE",
  write: "EVENT_TYPE_WRITE",
  remove: "EVENT_TYPE_REMOVE",
  rename: "EVENT_TYPE_RENAME",
  chmod: "EVENT_TYPE_CHMOD",
};

/** Events a polled watcher holds between two GetWatcherEvents; later ones are dropped (envd has no resync). */
export const MAX_POLLED_EVENTS = 10_000;

export function envdEventOf(watched: string, f: FileEventFrame): EnvdFsEvent | undefined {
  const name = posix.relative(watched, f.path);
  // An event of the watched directory itself has no name in envd; it is not reported.
  if (!name) return undefined;
  return { name, type: EVENT_TYPE[f.event] };
}

/**
 * Polled watchers a machine may hold at once, ended ones included (the agent's own bound is 64 live watches per
 * socket; an ended one is kept only to tell its next poll why it ended).
 */
export const MAX_POLLED_PER_MACHINE = 64;
/** An ended watcher nobody polled is dropped after this (a destroyed or paused sandbox's watchers end). */
const ENDED_KEPT_MS = 60_000;

type Polled = { machineId: string; events: EnvdFsEvent[]; pending: Set<Promise<void>>; stop: () => void; ended?: string; endedAt?: number };

/** The polled watchers (CreateWatcher …): held in memory, ended with their machine's stream socket. */
export function createPolledWatchers(processes: ProcessRegistry) {
  const watchers = new Map<string, Polled>();

  /** Drops ended watchers not polled within ENDED_KEPT_MS; then `machineId`'s oldest ended ones while it is at the bound. */
  function sweep(machineId: string) {
    const old = Date.now() - ENDED_KEPT_MS;
    for (const [id, w] of watchers) if (w.endedAt !== undefined && w.endedAt < old) watchers.delete(id);
    const own = [...watchers].filter(([, w]) => w.machineId === machineId);
    for (const [id, w] of own) {
      if (own.length < MAX_POLLED_PER_MACHINE) break;
      if (w.endedAt === undefined) continue;
      watchers.delete(id);
      own.splice(own.findIndex(([x]) => x === id), 1);
    }
    return own.length;
  }

  return {
    /** `entryAt` (includeEntry) stats an event's path; the event is held in order and filled when it answers. */
    async create(machineId: string, path: string, recursive: boolean, entryAt?: (path: string) => Promise<unknown>): Promise<string> {
      if (sweep(machineId) >= MAX_POLLED_PER_MACHINE) throw new ConnectFailure("resource_exhausted", `At most ${MAX_POLLED_PER_MACHINE} watchers per sandbox: remove one (RemoveWatcher) first`);
      const id = randomUUID();
      const entry: Polled = { machineId, events: [], pending: new Set<Promise<void>>(), stop: () => undefined };
      entry.stop = await processes.watch(machineId, path, recursive, (f) => {
        if (f.type === "end") {
          entry.ended = f.error;
          entry.endedAt = Date.now();
        } else if (f.type === "file_event" && entry.events.length < MAX_POLLED_EVENTS) {
          const e = envdEventOf(path, f);
          if (!e) return;
          entry.events.push(e);
          if (entryAt && f.event !== "remove") {
            const p = entryAt(f.path).then((info) => {
              if (info !== undefined) e.entry = info;
              entry.pending.delete(p);
            });
            entry.pending.add(p);
          }
        }
      });
      watchers.set(id, entry);
      return id;
    },
    async take(machineId: string, id: string): Promise<EnvdFsEvent[]> {
      const w = watchers.get(id);
      if (!w || w.machineId !== machineId) throw new ConnectFailure("not_found", `watcher ${id} not found`);
      // Events whose entry is still being stat'ed are answered with it.
      await Promise.all(w.pending);
      const events = w.events.splice(0);
      if (!events.length && w.endedAt !== undefined) {
        watchers.delete(id);
        throw new ConnectFailure("not_found", `watcher ${id} ended: ${w.ended ?? "its watch ended"}`);
      }
      return events;
    },
    remove(machineId: string, id: string) {
      const w = watchers.get(id);
      if (!w || w.machineId !== machineId) throw new ConnectFailure("not_found", `watcher ${id} not found`);
      watchers.delete(id);
      w.stop();
    },
  };
}
