// SPEC.md's WebSocket keepalive, shared by the machine and volume sockets: a Ping every interval; two unanswered in
// a row close the socket.

import type { WebSocket } from "ws";

export const MISSED_PONGS_BEFORE_CLOSE = 2;

/**
 * Starts pinging `client`; `onDead` runs once it missed too many pongs (after the socket is terminated). `held`
 * says when the client's pongs cannot be read (its input is paused for backpressure): they do not count as missed
 * then. Returns the function that stops the pings.
 */
export function keepAlive(client: WebSocket, opts: { intervalMs: number; onDead: () => void; held?: () => boolean }): () => void {
  let missed = 0;
  client.on("pong", () => {
    missed = 0;
  });
  const timer = setInterval(() => {
    if (opts.held?.()) missed = 0;
    if (missed >= MISSED_PONGS_BEFORE_CLOSE) {
      clearInterval(timer);
      client.terminate();
      opts.onDead();
      return;
    }
    missed++;
    client.ping();
  }, opts.intervalMs);
  return () => clearInterval(timer);
}
