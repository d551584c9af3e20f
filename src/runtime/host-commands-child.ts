// The small process that starts the host's commands for the server (host-commands.ts explains why). It holds no
// state but what its requests in flight need, trusts nothing but its parent's IPC channel, and exits with it.

import { spawn } from "node:child_process";
import type { StdioOptions } from "node:child_process";
import { closeSync, openSync } from "node:fs";
import type { Server } from "node:net";
import type { HostCommandReply, HostCommandRequest } from "./host-commands.ts";

const reply = (r: HostCommandReply) => process.send?.(r);

function run(req: HostCommandRequest, handle: Server | undefined) {
  const opened: number[] = [];
  const stdio: StdioOptions = req.stdio.map((s) => {
    if (s === "ignore" || s === "pipe") return s;
    if (s === "handle") {
      const fd = (handle as unknown as { _handle?: { fd: number } } | undefined)?._handle?.fd;
      if (fd === undefined || fd < 0) throw new Error("no listening socket was passed for this command");
      return fd;
    }
    const fd = openSync(s.append, "a");
    opened.push(fd);
    return fd;
  });
  const child = spawn(req.file, req.args, { stdio, detached: req.detached === true });
  for (const fd of opened) closeSync(fd);
  let done = false;
  const finish = (r: Omit<HostCommandReply, "id">) => {
    if (done) return;
    done = true;
    clearTimeout(timer);
    handle?.close();
    reply({ id: req.id, ...r });
  };
  const out: Buffer[] = [];
  const err: Buffer[] = [];
  let bytes = 0;
  const collect = (into: Buffer[]) => (d: Buffer) => {
    bytes += d.length;
    if (bytes > req.maxBuffer) {
      child.kill("SIGTERM");
      return finish({ error: { message: `maxBuffer length exceeded (${req.file})`, code: "ERR_CHILD_PROCESS_STDIO_MAXBUFFER" } });
    }
    into.push(d);
  };
  child.stdout?.on("data", collect(out));
  child.stderr?.on("data", collect(err));
  let killed = false;
  const timer = req.timeoutMs
    ? setTimeout(() => {
        killed = true;
        child.kill("SIGTERM");
      }, req.timeoutMs)
    : undefined;
  child.once("error", (e: NodeJS.ErrnoException) => finish({ error: { message: e.message, code: e.code } }));
  if (req.readyFd !== undefined) {
    const ready = child.stdio[req.readyFd] as NodeJS.ReadableStream & { destroy(): void };
    ready.once("data", () => {
      ready.destroy();
      child.unref();
      finish({ ready: true, pid: child.pid });
    });
  }
  // A command may end without reading all of it (nsenter into a machine already gone): the write's EPIPE is no
  // error of ours (its exit says what happened), and unhandled it would end this helper and every command in flight.
  child.stdin?.on("error", () => undefined);
  if (req.input !== undefined) child.stdin?.end(req.input);
  // "close", not "exit": the output is complete only once the pipes are.
  child.once("close", (code, signal) => finish({ code, signal, killed, pid: child.pid, stdout: Buffer.concat(out).toString(), stderr: Buffer.concat(err).toString() }));
}

process.on("message", (req: HostCommandRequest, handle: Server | undefined) => {
  try {
    run(req, handle);
  } catch (e) {
    handle?.close();
    reply({ id: req.id, error: { message: (e as Error).message, code: (e as NodeJS.ErrnoException).code } });
  }
});
// The server is gone (or let go of this helper): what was started keeps running, as it would have from the server.
process.on("disconnect", () => process.exit(0));
