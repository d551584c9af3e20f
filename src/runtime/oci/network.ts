// Outbound network for a machine: slirp4netns attached to the machine's network namespace (user-mode NAT, so
// no host bridge or firewall rules), detached so it outlives a control-plane restart. Host loopback is reachable
// at 10.0.2.2 only when host access is on.
//
// runc makes the namespace itself and slirp4netns joins it by the machine's pid once it runs. runsc copies the
// interfaces of a namespace into its own network stack when the sandbox starts, so for runsc the namespace is made
// first, kept alive by a bind mount on a file in the machine's directory, and wired before the sandbox exists.
//
// A slirp4netns that died is started again into the same namespace (oci/health.ts). runc: its tap device went with
// it, so the new one makes and configures a fresh tap0. runsc: gVisor holds a packet socket on the tap device it
// found at start, so that device must outlive slirp4netns — it is made persistent with the namespace — and a new
// slirp4netns only attaches to it (gVisor took the addresses into its own stack; there is nothing to configure).

import { execHost, startDaemon } from "../host-commands.ts";
import { existsSync } from "node:fs";
import { readFile, rm, writeFile } from "node:fs/promises";
import { isMounted } from "./mounts.ts";

// Started by the host command helper, not by the server's own thread (host-commands.ts).
const exec = execHost;

/** How long slirp4netns has to say it is ready before it is killed and the boot fails. */
const SLIRP_READY_MS = 5000;
export const SLIRP_GATEWAY = "10.0.2.2";
export const SLIRP_DNS = "10.0.2.3";
export const HOST_ALIAS = "host.kiln.internal";
/** The machine's network device, made by slirp4netns (runc) or with the namespace (runsc). */
const TAP = "tap0";

/** Where slirp4netns finds the namespace: the machine's first process, or a namespace file made by makeNetns. */
export type SlirpTarget = { pid: number } | { netnsPath: string };

/**
 * `cgroupProcs`: the cgroup.procs file of the machine's egress cgroup. slirp4netns is started by a shell that moves
 * itself there first, so every socket slirp4netns ever opens carries that cgroup (the host filters on it).
 * `quickAck` (a runc machine's boot, pid target only): the same shell first sets quickack on the machine's loopback
 * (quickAckLoopback), so a boot with internet runs one host command for its network, not two. That step failing is
 * written to the slirp log and does not stop the boot, as quickAckLoopback's failure does not.
 */
export async function startSlirp(opts: { target: SlirpTarget; hostAccess: boolean; pidFile: string; logFile: string; cgroupProcs: string; configure?: boolean; quickAck?: boolean }): Promise<number> {
  const target = "pid" in opts.target ? [String(opts.target.pid)] : ["--netns-type=path", opts.target.netnsPath];
  const args = [...(opts.configure === false ? [] : ["--configure"]), "--mtu=65520", "--ready-fd=3", ...(opts.hostAccess ? [] : ["--disable-host-loopback"]), ...target, TAP];
  const quickAck = opts.quickAck && "pid" in opts.target ? `${quickAckScript(opts.target.pid)}\n` : "";
  const inCgroup = ["-c", `echo 0 > "$0" || exit\n${quickAck}exec slirp4netns "$@"`, opts.cgroupProcs, ...args];
  // Started detached by the host command helper (host-commands.ts), which answers once slirp4netns says it is ready.
  const pid = await startDaemon("/bin/sh", inCgroup, { log: opts.logFile, timeoutMs: SLIRP_READY_MS }).catch((err: unknown) => {
    const e = err as { code?: unknown; signal?: unknown; message: string };
    if (e.signal === "SIGTERM") throw new Error(`slirp4netns did not become ready in ${SLIRP_READY_MS / 1000} s`);
    throw new Error(`slirp4netns ${e.message} (see ${opts.logFile})`);
  });
  await writeFile(opts.pidFile, String(pid));
  return pid;
}

/** Whether `pid` is (still) a slirp4netns: a recorded pid may be old (across restarts) and reused since. */
async function isSlirp(pid: number): Promise<boolean> {
  return (await readFile(`/proc/${pid}/cmdline`, "utf8").catch(() => "")).startsWith("slirp4netns\0");
}

/** Whether the slirp4netns recorded in `pidFile` is alive; false with no record. */
export async function slirpAlive(pidFile: string): Promise<boolean> {
  const pid = Number(await readFile(pidFile, "utf8").catch(() => ""));
  return pid > 0 && (await isSlirp(pid));
}

/** Kills the machine's slirp4netns and waits (up to 2 s) until it is gone, so its cgroup can be removed. */
export async function stopSlirp(pidFile: string): Promise<void> {
  const pid = Number(await readFile(pidFile, "utf8").catch(() => ""));
  if (!pid) return;
  if (await isSlirp(pid)) {
    try {
      process.kill(pid, "SIGKILL");
    } catch {
      // already gone
    }
    for (let i = 0; i < 200 && (await isSlirp(pid)); i++) await new Promise((r) => setTimeout(r, 10));
  }
  await rm(pidFile, { force: true });
}

/**
 * A new network namespace that lives as long as the bind mount on `path` (util-linux unshare makes it), holding a
 * persistent, unconfigured tap device for slirp4netns to attach to (and attach to again, should it die).
 * `path` must not hold one already: removeNetns first.
 */
export async function makeNetns(path: string): Promise<void> {
  await writeFile(path, "");
  try {
    await exec("unshare", [`--net=${path}`, "ip", "tuntap", "add", "dev", TAP, "mode", "tap"]);
  } catch (err) {
    throw new Error(`making the network namespace ${path} failed: ${((err as { stderr?: string }).stderr || (err as Error).message).trim()}`);
  }
}

/**
 * Turns off delayed ACKs on a runc machine's loopback (the `quickack` route metric on its local routes). Without it a
 * service that writes an answer's head and body in two sends (Python's http.server, many others) loses about 40 ms
 * on every kept-alive request: Nagle holds the body until the head is acknowledged, and the guest agent's end of
 * the connection (the edge's and the port proxy's way in) delays that ACK by the kernel's 40 ms minimum once the
 * connection looks interactive. Loopback has no wire to save ACKs for. runsc machines have gVisor's own stack.
 */
export async function quickAckLoopback(pid: number): Promise<void> {
  await exec("nsenter", [`--net=/proc/${pid}/ns/net`, "ip", "-batch", "-"], { timeout: 5000, input: QUICKACK_ROUTES.join("\n") + "\n" }).catch((err: { stderr?: string; message: string }) => {
    throw new Error(`setting quickack on the machine's loopback failed: ${(err.stderr || err.message).trim().slice(0, 300)}`);
  });
}

/** The `ip` batch quickAckLoopback runs: the loopback's two local routes, changed only in their quickack metric. */
const QUICKACK_ROUTES = ["127.0.0.1", "127.0.0.0/8"].map((dst) => `route change local ${dst} dev lo table local proto kernel scope host src 127.0.0.1 quickack 1`);

/** quickAckLoopback as a line of shell (startSlirp's): the routes are constant text, the pid a number. */
function quickAckScript(pid: number): string {
  if (!Number.isSafeInteger(pid) || pid <= 0) throw new Error(`not a pid: ${pid}`);
  const lines = QUICKACK_ROUTES.map((r) => `'${r}'`).join(" ");
  return `printf '%s\\n' ${lines} | timeout 2 nsenter --net=/proc/${pid}/ns/net ip -batch - || echo "kiln: setting quickack on the machine's loopback failed" >&2`;
}

/** Releases a namespace made by makeNetns: once unmounted and unused, the kernel frees it. */
export async function removeNetns(path: string): Promise<void> {
  if (!existsSync(path)) return;
  if (isMounted(path)) await exec("umount", [path]).catch(() => exec("umount", ["-l", path]));
  await rm(path, { force: true });
}
