// The data plane of one volume on this host: its file operations and its single watcher, shared by every watch
// subscription on it. The watcher starts with the first subscriber and stops with the last.

import type { Logger } from "../log.ts";
import { volumeFiles } from "./files.ts";
import type { VolumeFiles } from "./files.ts";
import { VolumeWatcher } from "./watcher.ts";
import type { FileEvent, ResyncReason, WatcherSink } from "./watcher.ts";

export interface DataPlane {
  /** Which host serves this volume's files and watches (one host here; a routing key for several). */
  readonly host: string;
  readonly files: VolumeFiles;
  /** Starts receiving the volume's events; resolves once the watcher covers the whole volume. */
  subscribe(sink: WatcherSink): Promise<() => Promise<void>>;
  /** Host pid of the watcher process, when one runs (tests end it to see a restart announced). */
  watcherPid(): number | undefined;
  close(): Promise<void>;
}

export const LOCAL_HOST = "local";

export function localDataPlane(opts: { mountPath: string; stagingDir: string; log: Logger }): DataPlane {
  const files = volumeFiles(opts.mountPath);
  const sinks = new Set<WatcherSink>();
  let watcher: VolumeWatcher | undefined;
  // Changes to the watcher's life (start, stop) happen one at a time.
  let lifecycle: Promise<unknown> = Promise.resolve();

  const fanOut: WatcherSink = {
    events(batch: FileEvent[]) {
      for (const s of sinks) s.events(batch);
    },
    resync(reason: ResyncReason) {
      for (const s of sinks) s.resync(reason);
    },
  };

  function serial<T>(fn: () => Promise<T>): Promise<T> {
    const next = lifecycle.then(fn, fn);
    lifecycle = next.catch(() => undefined);
    return next;
  }

  async function subscribe(sink: WatcherSink): Promise<() => Promise<void>> {
    await serial(async () => {
      if (!watcher) {
        const w = new VolumeWatcher({ mountPath: opts.mountPath, stagingDir: opts.stagingDir, files, sink: fanOut, log: opts.log });
        try {
          await w.start();
        } catch (err) {
          await w.stop();
          throw err;
        }
        watcher = w;
      }
      sinks.add(sink);
    });
    let done = false;
    return () => {
      if (done) return Promise.resolve();
      done = true;
      return serial(async () => {
        sinks.delete(sink);
        if (sinks.size === 0 && watcher) {
          const w = watcher;
          watcher = undefined;
          await w.stop();
        }
      });
    };
  }

  return {
    host: LOCAL_HOST,
    files,
    subscribe,
    watcherPid: () => watcher?.pid,
    close: () =>
      serial(async () => {
        sinks.clear();
        const w = watcher;
        watcher = undefined;
        await w?.stop();
      }),
  };
}
