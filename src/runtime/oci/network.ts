// Outbound network for a machine: slirp4netns attached to the machine's network namespace (user-mode NAT, so
// no host bridge or firewall rules), detached so it outlives a control-plane restart. Host loopback is reachable
// at 10.0.2.2 only when host access is on.

import { spawn } from "node:child_process";
import { openSync, closeSync } from "node:fs";
import { readFile, rm, writeFile } from "node:fs/promises";

export const SLIRP_GATEWAY = "10.0.2.2";
export const SLIRP_DNS = "10.0.2.3";
export const HOST_ALIAS = "host.kiln.internal";

export async function startSlirp(opts: { pid: number; hostAccess: boolean; pidFile: string; logFile: string }): Promise<number> {
  const log = openSync(opts.logFile, "a");
  const args = ["--configure", "--mtu=65520", "--ready-fd=3", ...(opts.hostAccess ? [] : ["--disable-host-loopback"]), String(opts.pid), "tap0"];
  const child = spawn("slirp4netns", args, { detached: true, stdio: ["ignore", log, log, "pipe"] });
  closeSync(log);
  const ready = child.stdio[3] as NodeJS.ReadableStream;
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error("slirp4netns did not become ready in 5 s")), 5000);
    ready.once("data", () => {
      clearTimeout(timer);
      resolve();
    });
    child.once("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`slirp4netns exited ${code} (see ${opts.logFile})`));
    });
    child.once("error", (err) => {
      clearTimeout(timer);
      reject(err);
    });
  });
  (ready as unknown as { destroy(): void }).destroy();
  child.unref();
  await writeFile(opts.pidFile, String(child.pid));
  return child.pid!;
}

export async function stopSlirp(pidFile: string): Promise<void> {
  const pid = Number(await readFile(pidFile, "utf8").catch(() => ""));
  if (!pid) return;
  // The pid was recorded maybe long ago (across restarts): only signal it if it is still a slirp4netns.
  const cmdline = await readFile(`/proc/${pid}/cmdline`, "utf8").catch(() => "");
  if (cmdline.startsWith("slirp4netns\0")) {
    try {
      process.kill(pid, "SIGKILL");
    } catch {
      // already gone
    }
  }
  await rm(pidFile, { force: true });
}
