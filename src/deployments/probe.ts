// The readiness probe of a service, run by the control plane through the guest agent's port tunnel: TCP (the port
// accepts a connection) or HTTP (GET readiness.path answers 2xx/3xx), each bounded by the probe timeout.

import type { Socket } from "node:net";

export interface ProbeSpec {
  port: number;
  /** HTTP path to GET; absent means a TCP probe. */
  path?: string;
  timeoutMs: number;
}

export type ProbeResult = { ok: true; kind: "tcp" | "http"; status?: number; ms: number } | { ok: false; kind: "tcp" | "http"; status?: number; error: string; ms: number };

export async function probe(connect: (port: number, timeoutMs: number) => Promise<Socket>, spec: ProbeSpec): Promise<ProbeResult> {
  const kind = spec.path ? "http" : "tcp";
  const started = performance.now();
  const ms = () => Math.round((performance.now() - started) * 100) / 100;
  let socket: Socket | undefined;
  let timer: NodeJS.Timeout | undefined;
  const deadline = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`no answer within ${spec.timeoutMs} ms`)), spec.timeoutMs);
  });
  // The tunnel's own bound is the probe's: connections a service never completes do not pile up between probes.
  const connecting = connect(spec.port, spec.timeoutMs);
  try {
    socket = await Promise.race([connecting, deadline]);
    if (!spec.path) return { ok: true, kind, ms: ms() };
    const status = await Promise.race([httpStatus(socket, spec.port, spec.path), deadline]);
    if (status >= 200 && status < 400) return { ok: true, kind, status, ms: ms() };
    return { ok: false, kind, status, error: `GET ${spec.path} answered ${status}`, ms: ms() };
  } catch (err) {
    return { ok: false, kind, error: (err as Error).message, ms: ms() };
  } finally {
    clearTimeout(timer);
    socket?.destroy();
    // A tunnel that opens after the deadline is closed too: a service that accepts late must not leave the server
    // one open connection per probe.
    connecting.then((late) => late.destroy(), () => undefined);
  }
}

/** Sends one GET and reads just the status line: the body is never read. */
function httpStatus(socket: Socket, port: number, path: string): Promise<number> {
  return new Promise((resolve, reject) => {
    let head = "";
    socket.on("data", (b: Buffer) => {
      head += b.toString("latin1");
      const eol = head.indexOf("\r\n");
      if (eol < 0) {
        if (head.length > 4096) reject(new Error("not an HTTP answer"));
        return;
      }
      const m = /^HTTP\/1\.[01] (\d{3})/.exec(head.slice(0, eol));
      if (m) resolve(Number(m[1]));
      else reject(new Error("not an HTTP answer"));
    });
    socket.once("error", reject);
    socket.once("end", () => reject(new Error("the connection closed before an answer")));
    socket.write(`GET ${path} HTTP/1.1\r\nhost: 127.0.0.1:${port}\r\nuser-agent: kiln-readiness\r\nconnection: close\r\n\r\n`);
  });
}
