// What the deployment tests share: a small Python service (HTTP, env echo, a streamed download and a WebSocket echo
// written with the standard library only), the command that runs it, and waits on service records.

import assert from "node:assert/strict";
import type { TestKiln } from "../support/kiln.ts";

/** Standard-library Python: GET /health (503 while /tmp/unhealthy exists), /env/<NAME>, /big?mb=N (streamed), /pid, and a WebSocket echo on /ws. */
export const APP_PY = String.raw`
import base64, hashlib, os, struct, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def text(self, code, body):
        b = body.encode()
        self.send_response(code)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        p = self.path.split("?")[0]
        if p == "/ws" and self.headers.get("upgrade", "").lower() == "websocket":
            return self.echo()
        if p == "/health":
            return self.text(503, "unwell") if os.path.exists("/tmp/unhealthy") else self.text(200, "ok")
        if p == "/pid":
            return self.text(200, str(os.getpid()))
        if p.startswith("/env/"):
            return self.text(200, os.environ.get(p[5:], ""))
        if p == "/big":
            mb = int(self.path.split("mb=")[1]) if "mb=" in self.path else 50
            chunk = bytes(range(256)) * 4096
            self.send_response(200)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(mb * len(chunk)))
            self.end_headers()
            for _ in range(mb):
                self.wfile.write(chunk)
            return
        if p == "/headers":
            return self.text(200, "\n".join(k.lower() + ": " + v for k, v in self.headers.items()))
        return self.text(200, "hello from " + p + " query " + (self.path.split("?")[1] if "?" in self.path else ""))
    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        got = hashlib.sha256()
        while n > 0:
            b = self.rfile.read(min(n, 65536))
            if not b:
                break
            got.update(b)
            n -= len(b)
        return self.text(200, got.hexdigest())
    def echo(self):
        key = self.headers["sec-websocket-key"]
        accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
        self.send_response(101)
        self.send_header("upgrade", "websocket")
        self.send_header("connection", "Upgrade")
        self.send_header("sec-websocket-accept", accept)
        self.end_headers()
        self.wfile.flush()
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
            head = bytes([128 | op])
            if len(data) < 126:
                head += bytes([len(data)])
            elif len(data) < 65536:
                head += bytes([126]) + struct.pack(">H", len(data))
            else:
                head += bytes([127]) + struct.pack(">Q", len(data))
            self.wfile.write(head + data)
            self.wfile.flush()
        self.close_connection = True

ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
`;

/** A shell line that writes the app into the machine and runs it on `port` (extra: a prefix such as `echo hi;`). */
export function appCommand(port: number): string {
  return `echo ${Buffer.from(APP_PY).toString("base64")} | base64 -d > /tmp/app.py && exec python3 /tmp/app.py ${port}`;
}

export async function waitService(k: TestKiln, depId: string, svcId: string, want: (s: any) => boolean, timeoutMs = 60_000): Promise<any> {
  const deadline = Date.now() + timeoutMs;
  let last: any;
  while (Date.now() < deadline) {
    const res = await k.call("GET", `/v1/agent-deployments/${depId}/services/${svcId}`);
    assert.equal(res.status, 200, res.text);
    last = res.body;
    if (want(last)) return last;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.fail(`service ${svcId} did not get there in time; last: ${JSON.stringify(last)}`);
}

export async function services(k: TestKiln, depId: string): Promise<any[]> {
  const res = await k.call("GET", `/v1/agent-deployments/${depId}/services`);
  assert.equal(res.status, 200, res.text);
  return res.body.services;
}

export async function createDeployment(k: TestKiln, body: Record<string, unknown>): Promise<any> {
  const res = await k.call("POST", "/v1/agent-deployments", { body: { template: "local/base", ...body } });
  assert.equal(res.status, 201, res.text);
  return res.body;
}
