// Loopback helpers the tests share: a free TCP port for a server process about to start, one of the host's own
// non-loopback addresses (what a machine reaches the host at), and a TCP listener that counts what it accepted.

import { createServer } from "node:net";
import type { AddressInfo, Server } from "node:net";
import { execFileSync } from "node:child_process";
import assert from "node:assert/strict";

/** A port free on 127.0.0.1 now (the caller's server binds it next). */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.on("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const port = (s.address() as AddressInfo).port;
      s.close(() => resolve(port));
    });
  });
}

/** One of the host's own addresses that is not loopback (what a listener on 0.0.0.0 is reachable at). */
export function hostAddress(): string {
  const out = execFileSync("ip", ["-4", "-o", "addr", "show"], { encoding: "utf8" });
  const addr = [...out.matchAll(/inet (\d+\.\d+\.\d+\.\d+)\//g)].map((m) => m[1]).find((a) => !a.startsWith("127."));
  assert.ok(addr, "the host has a non-loopback IPv4 address");
  return addr;
}

/** A TCP server on `host` that greets and counts every connection it accepts. */
export async function listenCounting(host: string): Promise<{ server: Server; port: number; accepted: () => number }> {
  let n = 0;
  const server = createServer((s) => {
    n++;
    s.end("hello from the host\n");
  });
  await new Promise<void>((resolve) => server.listen(0, host, resolve));
  return { server, port: (server.address() as AddressInfo).port, accepted: () => n };
}
