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

/** The polled watchers (CreateWatcher …): held in memory, ended with their machine's stream socket. */
export function createPolledWatchers(processes: ProcessRegistry) {
  const watchers = new Map<string, { machineId: string; events: EnvdFsEvent[]; pending: Set<Promise<void>>; stop: () => void; ended?: string }>();

  return {
    /** `entryAt` (includeEntry) stats an event's path; the event is held in order and filled when it answers. */
    async create(machineId: string, path: string, recursive: boolean, entryAt?: (path: string) => Promise<unknown>): Promise<string> {
      const id = randomUUID();
      const entry = { machineId, events: [] as EnvdFsEvent[], pending: new Set<Promise<void>>(), stop: () => undefined as void, ended: undefined as string | undefined };
      entry.stop = await processes.watch(machineId, path, recursive, (f) => {
        if (f.type === "end") entry.ended = f.error;
        else if (f.type === "file_event" && entry.events.length < MAX_POLLED_EVENTS) {
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
      if (!events.length && w.ended) {
        watchers.delete(id);
        throw new ConnectFailure("not_found", `watcher ${id} ended: ${w.ended}`);
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
