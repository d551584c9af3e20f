// GET /v1/machines/{id}/ws: the exec/PTY stream. Auth and "is the machine running" are answered as HTTP
// envelopes before any upgrade; after it, frames are checked here and relayed to the machine's guest agent,
// which owns processes and PTY sessions (so sessions outlive this socket). Keepalive and backpressure live here.

import type { WebSocket, RawData } from "ws";
import { Type } from "typebox";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { errors, Id } from "../schemas.ts";
import { checkClientFrame } from "../ws-frames.ts";
import { keepAlive } from "../ws-keepalive.ts";
import { DEFAULT_WORKDIR, resolveMachinePath } from "../../machines/paths.ts";
import { KilnError } from "../../errors.ts";

/** Stop reading the machine's output while the client has this much unsent; read again below the low mark. */
const HIGH_WATER = 4 * 1024 * 1024;
const LOW_WATER = 512 * 1024;
/** While the client is not read (backpressure), a ping this often notices that it went away. */
const PAUSED_PROBE_MS = 500;
/** Frames held while a new socket is wired up (a client that sends more before its first answer is refused). */
const EARLY_FRAMES_MAX = 256;

export async function machineWsRoutes(app: App, opts: { services: Services; pingIntervalMs: number }) {
  const { machines } = opts.services;

  app.get(
    "/v1/machines/:id/ws",
    {
      config: { auth: "key" },
      websocket: true,
      schema: {
        tags: ["WebSocket"],
        summary: "Exec and PTY streams (WebSocket upgrade); frames per DESIGN.md §5",
        params: Type.Object({ id: Id }),
        response: { ...errors(404, 409) },
      },
      // Refuse before the upgrade, with the HTTP envelope, when the machine is unknown or not running.
      preValidation: async (req) => {
        await machines.agentOf((req.params as { id: string }).id);
      },
    },
    async (client: WebSocket, req) => {
      const id = (req.params as { id: string }).id;
      const log = req.log.child({ machine_id: id });
      // Frames a client sends right after the upgrade arrive while the machine is looked up (a store round trip):
      // they are held, in order and bounded, and handled once the socket is wired — never dropped.
      const early: [RawData, boolean][] = [];
      const holdEarly = (data: RawData, isBinary: boolean) => {
        if (early.length < EARLY_FRAMES_MAX) early.push([data, isBinary]);
        else client.close(1008, "too many frames before the socket was ready");
      };
      client.on("message", holdEarly);
      let agentWs: WebSocket;
      let defaults: { user: string; cwd: string; machineCwd: string | null };
      try {
        const { row, agent } = await machines.agentOf(id);
        defaults = { user: row.user, cwd: row.cwd ?? DEFAULT_WORKDIR, machineCwd: row.cwd };
        agentWs = agent.openStream();
      } catch {
        client.close(1011, "machine not running");
        return;
      }
      client.off("message", holdEarly);
      const pending: string[] = [];
      let closed = false;

      const sendError = (error: string, request_id?: string, code = "invalid_request") => {
        if (client.readyState === client.OPEN) client.send(JSON.stringify({ type: "error", code, error, ...(request_id ? { request_id } : {}) }));
      };

      const shutdown = (code: number, reason: string) => {
        if (closed) return;
        closed = true;
        stopPings();
        clearInterval(probe);
        offStatus();
        if (agentWs.readyState === agentWs.OPEN || agentWs.readyState === agentWs.CONNECTING) agentWs.terminate();
        if (client.readyState === client.OPEN) client.close(code, reason);
      };

      // Client → machine backpressure: while the agent link has too much unsent (a process not reading its
      // stdin), this socket is not read, so the client's own sends back up instead of our memory.
      let inputPaused = false;
      let pendingBytes = 0;
      // A paused socket is not read, so a client that goes away meanwhile is only noticed by writing to it.
      let probe: NodeJS.Timeout | undefined;
      const relieveInput = () => {
        if (inputPaused && agentWs.bufferedAmount < LOW_WATER && pendingBytes < LOW_WATER) {
          inputPaused = false;
          clearInterval(probe);
          client.resume();
        }
      };
      const relay = (text: string) => {
        if (agentWs.readyState === agentWs.OPEN) agentWs.send(text, relieveInput);
        else {
          pending.push(text);
          pendingBytes += text.length;
        }
        if (!inputPaused && (agentWs.bufferedAmount > HIGH_WATER || pendingBytes > HIGH_WATER)) {
          inputPaused = true;
          client.pause();
          probe = setInterval(() => {
            if (client.readyState === client.OPEN) client.ping();
          }, PAUSED_PROBE_MS);
        }
      };

      // Client → machine: only frames that pass the schema and the exactly-one rules are relayed.
      const onClientFrame = (data: RawData, isBinary: boolean) => {
        if (isBinary) return sendError("Frames are JSON text");
        const check = checkClientFrame(data.toString());
        if (!check.ok) return sendError(check.error, check.request_id);
        const f = check.frame;
        // Processes start as the machine's user in its cwd unless the frame says otherwise (as REST exec does).
        if (f.type === "exec.start" || f.type === "pty.start") {
          f.user ??= defaults.user;
          f.cwd = typeof f.cwd === "string" ? resolveMachinePath(f.cwd, { machineCwd: defaults.machineCwd }) : defaults.cwd;
        }
        // Watch paths resolve as file paths do (relative to the machine's cwd); the agent watches inside the machine.
        if (f.type === "file_watch") f.path = resolveMachinePath(f.path as string, { machineCwd: defaults.machineCwd });
        relay(JSON.stringify(f));
      };
      // The frame handler's error boundary: whatever a frame does, the socket and the server live on.
      const onMessage = (data: RawData, isBinary: boolean) => {
        try {
          onClientFrame(data, isBinary);
        } catch (err) {
          if (err instanceof KilnError && err.status < 500) return sendError(err.message, undefined, err.code);
          log.error({ err }, "a machine socket frame failed");
          sendError("The frame could not be handled", undefined, "internal");
        }
      };
      client.on("message", onMessage);
      for (const [data, isBinary] of early.splice(0)) onMessage(data, isBinary);

      // Machine → client, with backpressure: a slow reader pauses the agent link, which pauses the PTY/pipes.
      let paused = false;
      agentWs.on("message", (data: RawData) => {
        if (client.readyState !== client.OPEN) return;
        // Relay the agent's text frame as the same bytes: no decode and re-encode on the hot path.
        client.send(data as Buffer, { binary: false }, () => {
          if (paused && client.bufferedAmount < LOW_WATER) {
            paused = false;
            agentWs.resume();
          }
        });
        if (!paused && client.bufferedAmount > HIGH_WATER) {
          paused = true;
          agentWs.pause();
        }
      });
      agentWs.on("open", () => {
        pendingBytes = 0;
        for (const text of pending.splice(0)) agentWs.send(text, relieveInput);
      });
      agentWs.on("close", () => shutdown(1011, "the machine's agent went away"));
      agentWs.on("error", (err) => {
        log.warn({ err }, "agent stream failed");
        shutdown(1011, "the machine's agent failed");
      });
      client.on("close", () => shutdown(1000, "closed"));
      client.on("error", () => shutdown(1011, "client error"));

      // Keepalive; pongs of a client held back by backpressure are not read yet, so they cannot count as missed.
      const stopPings = keepAlive(client, {
        intervalMs: opts.pingIntervalMs,
        held: () => inputPaused,
        onDead: () => {
          log.info("closing a machine socket after missed pongs");
          shutdown(1001, "missed pongs");
        },
      });

      // A hibernate or destroy ends this execution's streams.
      const offStatus = machines.onStatus((changed, status) => {
        if (changed === id && status !== "running") shutdown(1001, `machine ${status}`);
      });
    },
  );
}
