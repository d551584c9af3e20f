// Shared by the Dockerfile build security suites: a loopback registry holding a busybox image to build FROM, and
// what a test needs to see a build from the host's side — its processes, its key, and anything it left behind.

import { execFileSync, spawnSync } from "node:child_process";
import { existsSync, readFileSync, readdirSync } from "node:fs";
import { createServer } from "node:net";
import type { Server } from "node:net";
import { networkInterfaces } from "node:os";
import { join } from "node:path";
import { pushImage, registryAvailable, startRegistry } from "../support/oci-registry.ts";
import type { TestRegistry } from "../support/oci-registry.ts";
import { busyboxAvailable, busyboxRootfs, hostArchSupported } from "../support/mini-rootfs.ts";

export const BUILD_UID_BASE = 1_000_000_000;
export const BUILD_UID_RANGE = 65_536;

export function buildSkip(): string | undefined {
  const r = registryAvailable();
  if (r) return r;
  if (!hostArchSupported()) return "the busybox image is made from the host's x86-64 binary";
  if (!busyboxAvailable()) return "busybox-static is not installed (scripts/up.sh installs it)";
  if (spawnSync("buildah", ["--version"]).status !== 0) return "buildah is not installed (scripts/up.sh installs it)";
  return undefined;
}

/** A registry on loopback with `<host>/probe/busybox:1`; the server under test must list it as insecure. */
export async function busyboxRegistry(): Promise<{ reg: TestRegistry; image: string }> {
  const reg = await startRegistry();
  await pushImage(reg, "probe/busybox", "1", { layers: [{ entries: busyboxRootfs() }] });
  return { reg, image: `${reg.host}/probe/busybox:1` };
}

/** Every process on the host, with what a test asks about it. */
/**
 * Every live process on the host, with what a test asks about it. Zombies are dead (killed, not yet reaped by the
 * host's init, which a killed build's orphans are handed to) and are not listed.
 */
export function processes(): { pid: number; uid: number; cmdline: string; cgroup: string }[] {
  const out = [];
  for (const d of readdirSync("/proc")) {
    if (!/^\d+$/.test(d)) continue;
    try {
      const status = readFileSync(`/proc/${d}/status`, "utf8");
      if (/^State:\s+[ZX]/m.test(status)) continue;
      const uid = Number(/^Uid:\s+(\d+)/m.exec(status)?.[1]);
      const cmdline = readFileSync(`/proc/${d}/cmdline`, "utf8").replace(/\0/g, " ").trim();
      const cgroup = readFileSync(`/proc/${d}/cgroup`, "utf8");
      out.push({ pid: Number(d), uid, cmdline, cgroup });
    } catch {
      // gone meanwhile
    }
  }
  return out;
}

/** Pids whose command line contains `needle` (cheap enough to poll while a build runs in this process). */
export function cmdlinesHolding(needle: string): string[] {
  const out: string[] = [];
  for (const d of readdirSync("/proc")) {
    if (!/^\d+$/.test(d)) continue;
    try {
      const cmdline = readFileSync(`/proc/${d}/cmdline`, "latin1");
      if (cmdline.includes(needle)) out.push(`${d}: ${cmdline.replace(/\0/g, " ")}`);
    } catch {
      // gone meanwhile
    }
  }
  return out;
}

/** The build key (`bld-…`) in a process's cgroup path, if it belongs to a Dockerfile build. */
export function buildKeyOf(cgroup: string): string | undefined {
  return /\/kiln\/builds\/(bld-[^/\n]+)/.exec(cgroup)?.[1];
}

/** Processes of one build: in its cgroups, or in the build uid range with its key in their cgroup path. */
export function buildProcesses(key: string): { pid: number; uid: number; cmdline: string }[] {
  return processes().filter((p) => p.cgroup.includes(`/kiln/builds/${key}/`) || p.cgroup.includes(`/kiln/builds/${key}\n`) || p.cgroup.includes(`-${key}\n`) || p.cgroup.includes(`-${key}/`));
}

/** Everything a build could leave on the host, by what it is; empty when the build is fully gone. */
export function leftovers(key: string, dataDir: string): string[] {
  const left: string[] = [];
  for (const p of buildProcesses(key)) left.push(`process ${p.pid} (uid ${p.uid}): ${p.cmdline}`);
  for (const h of readdirSync("/sys/fs/cgroup")) {
    for (const dir of [join("/sys/fs/cgroup", h, "kiln/builds", key), join("/sys/fs/cgroup", h, "kiln-egress/isolated", `run-${key}`), join("/sys/fs/cgroup", h, "kiln-egress/isolated", `fetch-${key}`)]) {
      if (existsSync(dir)) left.push(`cgroup ${dir}`);
    }
  }
  for (const dir of [join("/run/kiln-builds", key), join(dataDir, "builder", key)]) if (existsSync(dir)) left.push(`dir ${dir}`);
  for (const line of readFileSync("/proc/self/mountinfo", "utf8").split("\n")) if (line.includes(key)) left.push(`mount ${line.split(" ")[4]}`);
  const nft = spawnSync("nft", ["list", "table", "inet", "kiln"]).stdout?.toString() ?? "";
  if (nft.includes(key.replace(/[^A-Za-z0-9_]/g, "_"))) left.push("nftables rules naming the build");
  return left;
}

/** Waits until `check` passes (polling; a loaded host may be slow), or throws naming `what`. */
export async function until<T>(what: string, check: () => T | undefined | false, timeoutMs = 60_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = check();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** A TCP listener that counts the connections it accepted. */
export async function listener(host: string): Promise<{ port: number; accepted(): number; close(): Promise<void> }> {
  let n = 0;
  const server: Server = createServer((s) => {
    n++;
    s.end("HTTP/1.0 200 OK\r\ncontent-length: 6\r\n\r\nMARKER");
  });
  await new Promise<void>((resolve) => server.listen(0, host, resolve));
  return { port: (server.address() as { port: number }).port, accepted: () => n, close: () => new Promise((r) => server.close(() => r())) };
}

/** The host's first non-loopback IPv4 address. */
export function hostAddress(): string {
  for (const list of Object.values(networkInterfaces())) for (const a of list ?? []) if (a.family === "IPv4" && !a.internal) return a.address;
  throw new Error("the host has no non-loopback IPv4 address");
}

/** Host pids of a machine's processes (its cgroup is /kiln/<machine id>). */
export function machinePids(machineId: string): number[] {
  return processes()
    .filter((p) => p.cgroup.includes(`/kiln/${machineId}\n`) || p.cgroup.includes(`/kiln/${machineId}/`))
    .map((p) => p.pid);
}

/** Files under `root` whose bytes contain `needle`; machines' sparse disk images (GiBs of holes, no build writes them) aside. */
export function filesHolding(root: string, needle: string): string[] {
  if (!existsSync(root)) return [];
  // Machines' disks (the reflink pool: disks/ on the sparse disks.xfs, or a disk.img) hold what machines wrote, and
  // reading a pool's gigabytes of holes would block this process for a minute.
  const r = spawnSync("grep", ["-rlaF", "--exclude=*.img", "--exclude=image.ext4", "--exclude=disks.xfs", "--exclude-dir=disks", "--", needle, root]);
  return r.stdout.toString().split("\n").filter(Boolean);
}

export function nftAvailable(): boolean {
  try {
    execFileSync("nft", ["--version"], { stdio: "ignore" });
    return true;
  } catch {
    return false;
  }
}
