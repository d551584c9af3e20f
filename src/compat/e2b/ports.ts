// `sandbox.getHost(port)` reached through Kiln: a request whose Host is `<port>-<sandbox id>.<domain>` (any port
// but envd's) goes, HTTP or WebSocket, to that port inside the machine through the guest agent's tunnel.
// It is taken off the HTTP server before Fastify routes it: its path belongs to the machine's server, not to Kiln.

import { request as httpRequest } from "node:http";
import type { IncomingMessage, Server, ServerResponse } from "node:http";
import type { Duplex } from "node:stream";
import type { MachineService } from "../../services/machines.ts";
import { KilnError } from "../../errors.ts";

/** The machine port a request is for, or undefined (envd's port and Kiln's own names are not port requests). */
export function portTargetOf(host: string | undefined, envdPort: number): { port: number; sandboxId: string } | undefined {
  const m = host ? SANDBOX_HOST_RE.exec(host) : null;
  if (!m) return undefined;
  const port = Number(m[1]);
  if (port === envdPort || port < 1 || port > 65535) return undefined;
  return { port, sandboxId: m[2] };
}

/** Only a Kiln machine id makes a Host a sandbox's, so a Kiln host that happens to start `<digits>-` stays Kiln's. */
export const SANDBOX_HOST_RE = /^(\d{1,5})-(mch_[0-9a-z]{26})\./;

const HOP_BY_HOP = new Set(["connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer", "proxy-authorization"]);

export function installPortProxy(server: Server, deps: { machines: MachineService; verify: (sandboxId: string, token: unknown) => boolean | Promise<boolean>; envdPort: number }) {
  async function open(req: IncomingMessage) {
    const target = portTargetOf(req.headers.host, deps.envdPort)!;
    // Traffic needs the sandbox's token (E2B's `e2b-traffic-access-token`, or its envd token header).
    const token = req.headers["e2b-traffic-access-token"] ?? req.headers["x-access-token"];
    if (!(await deps.verify(target.sandboxId, token))) throw new KilnError("unauthorized", "send the sandbox's access token in e2b-traffic-access-token");
    const { agent } = await deps.machines.agentOf(target.sandboxId);
    return agent.connectPort(target.port).catch((err: { status?: number; message?: string }) => {
      throw new KilnError(err?.status === 502 || err?.status === 404 ? "unavailable" : "machine_not_running", err?.message ?? "the port is not reachable");
    });
  }

  function refuse(res: ServerResponse, err: unknown) {
    const e = err instanceof KilnError ? err : new KilnError("internal", "the port could not be reached");
    const status = e.code === "unavailable" ? 502 : e.status;
    if (!res.headersSent) res.writeHead(status, { "content-type": "application/json" });
    res.end(JSON.stringify({ code: status, message: e.code === "internal" ? "Internal error" : e.message }));
  }

  function proxyHttp(req: IncomingMessage, res: ServerResponse) {
    open(req).then(
      (socket) => {
        const headers: Record<string, string | string[]> = {};
        for (const [k, v] of Object.entries(req.headers)) if (v !== undefined && !HOP_BY_HOP.has(k) && k !== "x-access-token" && k !== "e2b-traffic-access-token") headers[k] = v;
        const up = httpRequest({ method: req.method, path: req.url, headers, createConnection: () => socket });
        up.on("response", (r) => {
          const out: Record<string, string | string[]> = {};
          for (const [k, v] of Object.entries(r.headers)) if (v !== undefined && !HOP_BY_HOP.has(k)) out[k] = v;
          res.writeHead(r.statusCode ?? 502, out);
          r.pipe(res);
        });
        up.on("error", (err) => refuse(res, err));
        res.on("close", () => up.destroy());
        req.pipe(up);
      },
      (err) => refuse(res, err),
    );
  }

  function proxyUpgrade(req: IncomingMessage, client: Duplex, head: Buffer) {
    client.on("error", () => undefined);
    open(req).then(
      (socket) => {
        socket.on("error", () => client.destroy());
        client.on("close", () => socket.destroy());
        socket.on("close", () => client.destroy());
        const lines = [`${req.method} ${req.url} HTTP/1.1`];
        for (let i = 0; i < req.rawHeaders.length; i += 2) {
          const name = req.rawHeaders[i].toLowerCase();
          if (name !== "x-access-token" && name !== "e2b-traffic-access-token") lines.push(`${req.rawHeaders[i]}: ${req.rawHeaders[i + 1]}`);
        }
        socket.write(lines.join("\r\n") + "\r\n\r\n");
        if (head.length) socket.write(head);
        socket.pipe(client);
        client.pipe(socket);
      },
      (err) => {
        const e = err instanceof KilnError ? err : new KilnError("internal", "the port could not be reached");
        const status = e.code === "unavailable" ? 502 : e.status;
        client.end(`HTTP/1.1 ${status} Refused\r\nconnection: close\r\ncontent-length: 0\r\n\r\n`);
      },
    );
  }

  // Fastify's own listeners run for everything else, exactly as before.
  for (const event of ["request", "upgrade"] as const) {
    const previous = server.listeners(event) as ((...args: unknown[]) => void)[];
    server.removeAllListeners(event);
    server.on(event, (...args: unknown[]) => {
      const req = args[0] as IncomingMessage;
      if (portTargetOf(req.headers.host, deps.envdPort)) {
        if (event === "request") return proxyHttp(req, args[1] as ServerResponse);
        return proxyUpgrade(req, args[1] as Duplex, args[2] as Buffer);
      }
      for (const l of previous) l(...args);
    });
  }
}
