// An impostor on a machine's agent socket, as machine root would run one if it could take the agent's place: it
// answers the calls a resume makes like an agent, and every exec with what the `cmd` asks for —
//   "giant":   an endless chunked JSON answer, as fast as the socket takes it (700 MB and more);
//   "trickle": headers at once, then one byte a second, forever;
//   "silent":  never any headers.
// A WebSocket upgrade gets one 16 MiB frame. Run as its own process (so its memory is not the server's):
//   node impostor-agent.ts <socket path>      — prints "ready" once listening.

import { createServer } from "node:http";
import { createHash } from "node:crypto";
import { rmSync } from "node:fs";

const path = process.argv[2];
rmSync(path, { force: true });

const CHUNK = Buffer.alloc(1024 * 1024, "A");

const server = createServer((req, res) => {
  const chunks: Buffer[] = [];
  req.on("data", (c: Buffer) => chunks.push(c));
  req.on("end", () => {
    const url = req.url ?? "/";
    if (url === "/health") return json(res, { ok: true, boot_id: "impostor", pid: process.pid, uptime_ms: 1 });
    if (url === "/sessions/reset") return json(res, { ended: 0 });
    if (url.startsWith("/users/")) return json(res, { name: "root", uid: 0, gid: 0, home: "/root", shell: "/bin/sh" });
    let cmd = "";
    try {
      cmd = String(JSON.parse(Buffer.concat(chunks).toString() || "{}").cmd ?? "");
    } catch {
      // not an exec
    }
    if (cmd === "silent") return; // never answers
    res.writeHead(200, { "content-type": "application/json" });
    if (cmd === "trickle") {
      res.write('{"exit_code":0,"stdout_base64":"');
      const timer = setInterval(() => res.write("A"), 1000);
      res.on("close", () => clearInterval(timer));
      return;
    }
    // giant (and anything else): write as fast as the reader takes it, until it goes away.
    res.write('{"exit_code":0,"signal":null,"stderr_base64":"","duration_ms":1,"timed_out":false,"stdout_base64":"');
    const pump = () => {
      while (!res.destroyed && res.write(CHUNK));
    };
    res.on("drain", pump);
    pump();
  });
});

// One oversized frame on the stream socket (a hand-made WebSocket handshake: this process needs no dependency).
server.on("upgrade", (req, socket) => {
  const accept = createHash("sha1").update(`${req.headers["sec-websocket-key"]}258EAFA5-E914-47DA-95CA-C5AB0DC85B11`).digest("base64");
  socket.write(`HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-accept: ${accept}\r\n\r\n`);
  const size = 16 * 1024 * 1024;
  const header = Buffer.alloc(10);
  header[0] = 0x81; // FIN, text
  header[1] = 127;
  header.writeBigUInt64BE(BigInt(size), 2);
  socket.write(header);
  socket.write(Buffer.alloc(size, "A"));
  socket.on("error", () => undefined);
});

function json(res: import("node:http").ServerResponse, body: unknown) {
  const text = JSON.stringify(body);
  res.writeHead(200, { "content-type": "application/json", "content-length": Buffer.byteLength(text) });
  res.end(text);
}

server.listen(path, () => process.stdout.write("ready\n"));
process.on("SIGTERM", () => process.exit(0));
