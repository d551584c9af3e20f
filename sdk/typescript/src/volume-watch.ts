// GET /v1/volumes/{id}/ws: file watches on a shared volume. Each watch hands on file events and `resync_required`
// (events may have been lost: re-list the tree) to its callback.

import type { KilnOptions } from "./client.ts";
import { KilnApiError } from "./errors.ts";
import type { FileEvent, ResyncRequired } from "./frames.ts";
import { openFrameSocket, requestId } from "./socket.ts";
import type { FrameSocket } from "./socket.ts";

export interface VolumeWatch {
  watchId: string;
  path: string;
  unwatch(): Promise<void>;
}

export class VolumeWatcher {
  private readonly socket: FrameSocket;
  readonly volumeId: string;

  private constructor(socket: FrameSocket, volumeId: string) {
    this.socket = socket;
    this.volumeId = volumeId;
  }

  static async open(opts: KilnOptions, volumeId: string): Promise<VolumeWatcher> {
    return new VolumeWatcher(await openFrameSocket(opts, `v1/volumes/${encodeURIComponent(volumeId)}/ws`), volumeId);
  }

  /** Watches `path` (rooted at the volume's `/`); resolves once the watch is in place, so no later change is missed. */
  async watch(path: string, onEvent: (e: FileEvent | ResyncRequired) => void, opts: { recursive?: boolean } = {}): Promise<VolumeWatch> {
    const id = requestId();
    const socket = this.socket;
    const started = await new Promise<{ watch_id: string; path: string }>((resolve, reject) => {
      socket.on((f) => {
        if (!("request_id" in f) || f.request_id !== id) return false;
        if (f.type === "file_watch.started") resolve(f);
        else if (f.type === "error") reject(new KilnApiError(400, { code: f.code, error: f.error }));
        else return false;
        return true;
      });
      socket.send({ type: "file_watch", request_id: id, path, ...(opts.recursive ? { recursive: true } : {}) });
    });
    const watchId = started.watch_id;
    let active = true;
    socket.on((f) => {
      if (!active) return true;
      if ((f.type === "file_event" || f.type === "resync_required") && f.watch_id === watchId) onEvent(f);
      return false;
    });
    return {
      watchId,
      path: started.path,
      unwatch: async () => {
        active = false;
        const done = new Promise<void>((resolve) =>
          socket.on((f) => {
            if (f.type !== "file_unwatch.done" || f.watch_id !== watchId) return false;
            resolve();
            return true;
          }),
        );
        socket.send({ type: "file_unwatch", watch_id: watchId });
        await Promise.race([done, socket.closed]);
      },
    };
  }

  close(): Promise<number> {
    this.socket.close();
    return this.socket.closed;
  }
}
