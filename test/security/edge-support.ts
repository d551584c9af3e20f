// What the edge's hostile-client tests share: a service that shows the client what reached it (its request headers),
// hangs or stalls on demand, and speaks WebSocket; and a raw HTTP/1.1 client that can put several requests on one
// socket (the only way to see whether a connection became a pipe).

import { connect } from "node:net";
import type { Socket } from "node:net";

/**
 * Standard-library Python, threaded: GET /headers (the request head it got, and `upgrade:` if any), /hang (never
 * answers; appends a line to /tmp/hangs first), /stall (a head, one byte, then silence), /ws (a WebSocket whose first
 * frame is the request head it got, then an echo), anything else "hello from <path>"; POST reads its whole body first.
 */
export const PROBE_PY = String.raw`
import base64, hashlib, os, struct, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def head_text(self):
        return "\n".join(k.lower() + ": " + v for k, v in self.headers.items())
    def text(self, code, body):
        b = body.encode()
        self.send_response(code)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def frame(self, data):
        head = bytes([0x81])
        if len(data) < 126:
            head += bytes([len(data)])
        elif len(data) < 65536:
            head += bytes([126]) + struct.pack(">H", len(data))
        else:
            head += bytes([127]) + struct.pack(">Q", len(data))
        self.wfile.write(head + data)
        self.wfile.flush()
    def do_GET(self):
        p = self.path.split("?")[0]
        if p == "/ws" and self.headers.get("upgrade", "").lower() == "websocket":
            return self.ws()
        if p == "/headers":
            return self.text(200, self.head_text())
        if p == "/hang":
            with open("/tmp/hangs", "a") as f:
                f.write("1\n")
            time.sleep(3600)
            return
        if p == "/stall":
            self.send_response(200)
            self.send_header("content-length", "100")
            self.end_headers()
            self.wfile.write(b"x")
            self.wfile.flush()
            time.sleep(3600)
            return
        return self.text(200, "hello from " + p)
    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        return self.text(200, "got %d bytes" % len(self.rfile.read(n)))
    def ws(self):
        key = self.headers["sec-websocket-key"]
        accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
        self.send_response(101)
        self.send_header("upgrade", "websocket")
        self.send_header("connection", "Upgrade")
        self.send_header("sec-websocket-accept", accept)
        self.end_headers()
        self.frame(self.head_text().encode())
        while True:
            h = self.rfile.read(2)
            if len(h) < 2:
                break
            op, n = h[0] & 15, h[1] & 127
            if n == 126:
                n = struct.unpack(">H", self.rfile.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4) if h[1] & 128 else bytes(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
            if op == 8:
                self.wfile.write(b"\x88\x00")
                break
            self.frame(data)
        self.close_connection = True

class S(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

S(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
`;

/** A shell line that writes the probe into the machine and runs it on `port`. */
export function probeCommand(port: number): string {
  return `echo ${Buffer.from(PROBE_PY).toString("base64")} | base64 -d > /tmp/probe.py && exec python3 /tmp/probe.py ${port}`;
}

/** A raw HTTP/1.1 connection: write bytes, read what comes, see it end. */
export interface RawConnection {
  socket: Socket;
  write(text: string): void;
  /** Everything received so far. */
  received(): string;
  /** Resolves once the received text matches, or the connection ended (then with what came). */
  waitFor(pattern: RegExp, timeoutMs?: number): Promise<string>;
  /** Resolves true when the server ended the connection within the time, false if it stayed open. */
  ended(timeoutMs?: number): Promise<boolean>;
  close(): void;
}

export async function rawConnection(url: string): Promise<RawConnection> {
  const u = new URL(url);
  const socket = connect(Number(u.port), u.hostname);
  await new Promise<void>((resolve, reject) => {
    socket.once("connect", resolve);
    socket.once("error", reject);
  });
  let text = "";
  let closed = false;
  socket.on("data", (d: Buffer) => (text += d.toString("latin1")));
  socket.on("error", () => undefined);
  socket.on("close", () => (closed = true));
  const waitUntil = (done: () => boolean, timeoutMs: number) =>
    new Promise<void>((resolve) => {
      const started = Date.now();
      const check = () => {
        if (done() || Date.now() - started > timeoutMs) return resolve();
        setTimeout(check, 20);
      };
      check();
    });
  return {
    socket,
    write: (t) => void socket.write(t),
    received: () => text,
    async waitFor(pattern, timeoutMs = 15_000) {
      await waitUntil(() => pattern.test(text) || closed, timeoutMs);
      return text;
    },
    async ended(timeoutMs = 5_000) {
      await waitUntil(() => closed, timeoutMs);
      return closed;
    },
    close: () => socket.destroy(),
  };
}
