// GET /v1/volumes/{id}/ws: file watches on a volume. Auth and an unknown volume are answered as HTTP envelopes
// before the upgrade; after it, each file_watch resolves the volume's data plane and subscribes to its watcher.
// Every watch has a bounded queue: a client too slow for it gets resync_required instead of an unbounded backlog.

import type { WebSocket, RawData } from "ws";
import { Type } from "typebox";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { errors, Id } from "../schemas.ts";
import { keepAlive } from "../ws-keepalive.ts";
import { checkWatchFrame, watchCovers } from "../../volumes/watch-frames.ts";
import type { FileEvent, ResyncReason } from "../../volumes/watcher.ts";
import { volumePathComponents, volumePathOf } from "../../volumes/files.ts";
import { KilnError } from "../../errors.ts";

/** Stop handing frames to the socket while this much is unsent; the per-watch queues hold the rest. */
const HIGH_WATER = 1024 * 1024;
const MAX_WATCHES_PER_SOCKET = 256;

interface Watch {
  id: string;
  path: string;
  recursive: boolean;
  /** Frames not yet handed to the socket, at most `queueSize`. */
  queue: { text: string; resync: boolean }[];
  /** A resync_required frame sits in the queue: events dropped now are covered by the re-list it asks for. */
  resyncQueued: boolean;
  ready: boolean;
  unsubscribe: () => Promise<void>;
}

export async function volumeWsRoutes(app: App, opts: { services: Services; pingIntervalMs: number; queueSize: number }) {
  const { volumes } = opts.services;

  app.get(
    "/v1/volumes/:id/ws",
    {
      config: { auth: "key" },
      websocket: true,
      schema: {
        tags: ["WebSocket"],
        summary: "Volume file watches (WebSocket upgrade); frames per DESIGN.md §5",
        params: Type.Object({ id: Id }),
        response: { ...errors(404) },
      },
      // Refuse before the upgrade, with the HTTP envelope, when the volume is unknown.
      preValidation: async (req) => {
        await volumes.get((req.params as { id: string }).id);
      },
    },
    (client: WebSocket, req) => {
      const volumeId = (req.params as { id: string }).id;
      const log = req.log.child({ volume_id: volumeId });
      const watches = new Map<string, Watch>();
      let nextWatch = 1;
      let closed = false;
      let draining = false;
      let backedUp = false;
      const flushed = () => {
        if (!backedUp) return;
        backedUp = false;
        schedule();
      };

      const send = (frame: Record<string, unknown>) => {
        if (client.readyState === client.OPEN) client.send(JSON.stringify(frame));
      };
      const sendError = (code: string, error: string, extra: Record<string, unknown> = {}) => send({ type: "error", code, error, ...extra });

      /** Hands queued frames to the socket, round-robin over watches, while the socket is not backed up. */
      function drain() {
        draining = false;
        if (closed || client.readyState !== client.OPEN) return;
        let progress = true;
        while (progress && client.bufferedAmount < HIGH_WATER) {
          progress = false;
          for (const w of watches.values()) {
            if (!w.ready || w.queue.length === 0) continue;
            const frame = w.queue.shift()!;
            if (frame.resync) w.resyncQueued = false;
            client.send(frame.text, flushed);
            progress = true;
          }
        }
        // Backed up: the send callback of what the socket holds brings us back once it is flushed.
        if (client.bufferedAmount >= HIGH_WATER) backedUp = true;
      }
      function schedule() {
        if (draining) return;
        draining = true;
        setImmediate(drain);
      }

      function enqueue(w: Watch, frame: string) {
        if (w.queue.length < opts.queueSize) {
          w.queue.push({ text: frame, resync: false });
        } else if (!w.resyncQueued) {
          // Events are being lost for this client: drop what is queued and ask it to re-list instead.
          w.queue = [resyncFrame(w, "slow_client")];
          w.resyncQueued = true;
        }
        schedule();
      }

      function resync(w: Watch, reason: ResyncReason) {
        if (w.resyncQueued) return;
        // Older queued events are still true; the resync goes after them (and, if the queue is full, replaces them).
        if (w.queue.length >= opts.queueSize) w.queue = [];
        w.queue.push(resyncFrame(w, reason));
        w.resyncQueued = true;
        schedule();
      }

      async function startWatch(f: { request_id?: string; path: string; recursive?: boolean }) {
        const request_id = f.request_id;
        if (watches.size >= MAX_WATCHES_PER_SOCKET) return sendError("invalid_request", `At most ${MAX_WATCHES_PER_SOCKET} watches per socket`, request_id ? { request_id } : {});
        let path: string;
        try {
          path = volumePathOf(volumePathComponents(f.path));
        } catch (err) {
          return sendError("invalid_request", (err as Error).message, request_id ? { request_id } : {});
        }
        const w: Watch = { id: `w${nextWatch++}`, path, recursive: f.recursive === true, queue: [], resyncQueued: false, ready: false, unsubscribe: async () => undefined };
        watches.set(w.id, w);
        try {
          // Each subscription asks which host serves the volume now (SPEC.md), then subscribes there.
          const plane = await volumes.resolveDataPlane(volumeId);
          w.unsubscribe = await plane.subscribe({
            events(batch: FileEvent[]) {
              for (const e of batch) {
                if (watchCovers(w.path, w.recursive, e.path)) enqueue(w, JSON.stringify({ type: "file_event", watch_id: w.id, event: e.event, path: e.path, is_dir: e.isDir }));
              }
            },
            resync: (reason) => resync(w, reason),
          });
          // Subscribed first, checked second: nothing that happens after the check can be missed.
          if (!(await plane.files.exists(path))) throw new KilnError("not_found", `No such file or directory in the volume: ${path}`);
          if (closed || !watches.has(w.id)) return void (await w.unsubscribe());
          send({ type: "file_watch.started", request_id: request_id ?? null, watch_id: w.id, path });
          w.ready = true;
          schedule();
        } catch (err) {
          watches.delete(w.id);
          await w.unsubscribe();
          const e = err instanceof KilnError ? err : undefined;
          if (!e) log.error({ err }, "opening a volume watch failed");
          sendError(e?.code ?? "internal", e?.message ?? "The watch could not be opened", request_id ? { request_id } : {});
        }
      }

      async function stopWatch(f: { request_id?: string; watch_id: string }) {
        const w = watches.get(f.watch_id);
        if (!w) return sendError("not_found", `No watch ${f.watch_id} on this socket`, { ...(f.request_id ? { request_id: f.request_id } : {}), watch_id: f.watch_id });
        watches.delete(w.id);
        await w.unsubscribe();
        send({ type: "file_unwatch.done", request_id: f.request_id ?? null, watch_id: w.id });
      }

      function shutdown(code: number, reason: string) {
        if (closed) return;
        closed = true;
        stopPings();
        offDeleted();
        for (const w of watches.values()) void w.unsubscribe().catch((err: unknown) => log.warn({ err }, "ending a volume watch failed"));
        watches.clear();
        if (client.readyState === client.OPEN) client.close(code, reason);
      }

      client.on("message", (data: RawData, isBinary: boolean) => {
        if (isBinary) return sendError("invalid_request", "Frames are JSON text");
        const check = checkWatchFrame(data.toString());
        if (!check.ok) return sendError("invalid_request", check.error, check.request_id ? { request_id: check.request_id } : {});
        const f = check.frame;
        const work = f.type === "file_watch" ? startWatch(f) : stopWatch(f);
        work.catch((err: unknown) => log.error({ err }, "a volume watch frame failed"));
      });
      client.on("close", () => shutdown(1000, "closed"));
      client.on("error", () => shutdown(1011, "client error"));

      // A deleted volume ends every watch on it with an error frame, then the socket.
      const offDeleted = volumes.onDeleted((deleted) => {
        if (deleted !== volumeId || closed) return;
        for (const w of watches.values()) sendError("not_found", `Volume ${volumeId} was deleted`, { watch_id: w.id });
        if (watches.size === 0) sendError("not_found", `Volume ${volumeId} was deleted`);
        shutdown(1001, "volume deleted");
      });

      // Keepalive as on the machine socket: a Ping every interval; two unanswered in a row close the socket.
      const stopPings = keepAlive(client, {
        intervalMs: opts.pingIntervalMs,
        onDead: () => {
          log.info("closing a volume socket after missed pongs");
          shutdown(1001, "missed pongs");
        },
      });
    },
  );
}

function resyncFrame(w: Watch, reason: ResyncReason) {
  return { text: JSON.stringify({ type: "resync_required", watch_id: w.id, path: w.path, reason }), resync: true };
}
