// A real webhook receiver on loopback for the tests: records every request (headers and raw body) and answers as
// the test says; tests wait on the requests it records, never on the clock.

import { createServer } from "node:http";
import type { IncomingHttpHeaders, Server } from "node:http";
import { EventEmitter } from "node:events";

export interface Received {
  path: string;
  headers: IncomingHttpHeaders;
  body: string;
  at: number;
}

export interface Reply {
  status: number;
  headers?: Record<string, string>;
  body?: string;
}

export interface Receiver {
  url: string;
  received: Received[];
  /** How the next requests are answered (default 200). May wait, to play a slow receiver. */
  respond: (req: Received) => Reply | Promise<Reply>;
  /** Resolves with the first request (already received or to come) that matches. */
  waitFor(match: (r: Received) => boolean, timeoutMs?: number): Promise<Received>;
  /** Resolves once `count` matching requests have arrived. */
  waitForCount(match: (r: Received) => boolean, count: number, timeoutMs?: number): Promise<Received[]>;
  close(): Promise<void>;
}

export async function startReceiver(): Promise<Receiver> {
  const arrivals = new EventEmitter();
  arrivals.setMaxListeners(0);
  const received: Received[] = [];
  const receiver: Receiver = {
    url: "",
    received,
    respond: () => ({ status: 200, body: "ok" }),
    waitFor: async (match, timeoutMs) => (await receiver.waitForCount(match, 1, timeoutMs))[0],
    waitForCount(match, count, timeoutMs = 20_000) {
      return new Promise((resolve, reject) => {
        const check = () => {
          const hits = received.filter(match);
          if (hits.length < count) return false;
          clearTimeout(timer);
          arrivals.off("request", check);
          resolve(hits);
          return true;
        };
        const timer = setTimeout(() => {
          arrivals.off("request", check);
          reject(new Error(`the receiver got ${received.filter(match).length} of ${count} expected requests in ${timeoutMs} ms`));
        }, timeoutMs);
        if (!check()) arrivals.on("request", check);
      });
    },
    close: () => new Promise<void>((resolve) => {
      server.closeAllConnections();
      server.close(() => resolve());
    }),
  };
  const server: Server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("end", () => {
      const r: Received = { path: req.url ?? "/", headers: req.headers, body: Buffer.concat(chunks).toString("utf8"), at: performance.now() };
      received.push(r);
      arrivals.emit("request");
      void Promise.resolve(receiver.respond(r)).then(
        (reply) => {
          res.writeHead(reply.status, reply.headers);
          res.end(reply.body ?? "");
        },
        () => res.destroy(),
      );
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  receiver.url = `http://127.0.0.1:${(server.address() as { port: number }).port}`;
  return receiver;
}
