// Requests as bytes on a socket (net.connect), so no client library normalizes, re-encodes or refuses the request
// target a hostile caller would send.

import { connect } from "node:net";

export interface RawAnswer {
  status: number;
  head: string;
  body: string;
}

/** A WebSocket upgrade's headers, as a browser or the `ws` library sends them. */
export const UPGRADE_HEADERS = { connection: "Upgrade", upgrade: "websocket", "sec-websocket-version": "13", "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==" };

/**
 * Sends `method target HTTP/1.1` with `headers` and reads the answer's head (and the body that came with it, up to
 * a close or 300 ms of quiet after the head). A 101 answer is read only to its head; the socket is then destroyed.
 */
export function rawRequest(port: number, method: string, target: string, headers: Record<string, string> = {}, body = ""): Promise<RawAnswer> {
  return new Promise((resolve, reject) => {
    const socket = connect(port, "127.0.0.1");
    let data = "";
    let settled = false;
    let quiet: NodeJS.Timeout | undefined;
    const finish = () => {
      if (settled) return;
      settled = true;
      clearTimeout(quiet);
      clearTimeout(deadline);
      socket.destroy();
      const end = data.indexOf("\r\n\r\n");
      const head = end < 0 ? data : data.slice(0, end);
      const status = Number(/^HTTP\/1\.1 (\d{3})/.exec(head)?.[1] ?? 0);
      const raw = end < 0 ? "" : data.slice(end + 4);
      resolve({ status, head, body: /\r\ntransfer-encoding: chunked/i.test(head) ? dechunk(raw) : raw });
    };
    const deadline = setTimeout(() => (settled ? undefined : finish()), 10_000);
    socket.on("data", (chunk) => {
      data += chunk.toString("latin1");
      if (data.includes("\r\n\r\n")) {
        if (data.startsWith("HTTP/1.1 101")) return finish();
        clearTimeout(quiet);
        quiet = setTimeout(finish, 300);
        const m = /\r\ncontent-length: (\d+)/i.exec(data);
        if (m && data.length >= data.indexOf("\r\n\r\n") + 4 + Number(m[1])) finish();
      }
    });
    socket.on("close", finish);
    socket.on("error", (err) => (data ? finish() : settled ? undefined : ((settled = true), reject(err))));
    const lines = [`${method} ${target} HTTP/1.1`, "Host: kiln.test"];
    if (!Object.keys(headers).some((k) => k.toLowerCase() === "connection")) lines.push("Connection: close");
    for (const [k, v] of Object.entries(headers)) lines.push(`${k}: ${v}`);
    if (body || ["POST", "PUT", "PATCH"].includes(method)) lines.push(`Content-Length: ${Buffer.byteLength(body)}`);
    socket.write(lines.join("\r\n") + "\r\n\r\n" + body);
  });
}

function dechunk(raw: string): string {
  let out = "";
  let at = 0;
  for (;;) {
    const eol = raw.indexOf("\r\n", at);
    if (eol < 0) return out;
    const size = parseInt(raw.slice(at, eol), 16);
    if (!size) return out;
    out += raw.slice(eol + 2, eol + 2 + size);
    at = eol + 2 + size + 2;
  }
}

/** Runs `jobs` with at most `width` at a time, in order of their results. */
export async function inParallel<T, R>(items: T[], width: number, fn: (item: T) => Promise<R>): Promise<R[]> {
  const out: R[] = new Array(items.length);
  let next = 0;
  await Promise.all(
    Array.from({ length: Math.min(width, items.length) }, async () => {
      while (next < items.length) {
        const i = next++;
        out[i] = await fn(items[i]);
      }
    }),
  );
  return out;
}
