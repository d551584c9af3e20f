// The base template `local/base`: Debian bookworm minbase from the host's Debian mirror plus the tools agents
// expect, a `user` account and /workspace — made once, cached, and written with ownership already shifted into
// the canonical uid range (machine uid 0 = host 100000), so every machine can share it read-only (seen through
// idmapped mounts by machines on ranges of their own).

import { spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, readFileSync, readdirSync, readlinkSync } from "node:fs";
import { lstat, lchown, chmod, mkdir, readdir, readFile, rename, rm, writeFile } from "node:fs/promises";
import { join } from "node:path";
import type { Logger } from "../log.ts";
import { HOST_ID_BASE } from "../runtime/oci/idmap.ts";
import { pidAlive } from "../runtime/pid-alive.ts";

/** Bump when the recipe below changes: a new version is a new cache entry (and a new artifact). */
export const BASE_TEMPLATE_VERSION = "bookworm-2";
/** The account every base-template machine runs as unless told otherwise (uid 1000, home /home/user). */
export const BASE_USER = "user";
export const BASE_PACKAGES = ["ca-certificates", "curl", "git", "openssh-client", "python3", "python3-pip", "python3-venv", "python3-ipykernel", "python-is-python3", "procps"];

export interface BaseTemplate {
  layerDir: string;
  digest: string;
  created: boolean;
}

/** The first Debian mirror apt is configured with on this host (deb822 .sources or sources.list). */
export function hostDebianMirror(): string {
  const candidates: string[] = [];
  const dir = "/etc/apt/sources.list.d";
  if (existsSync(dir)) for (const f of readdirSync(dir).filter((f) => f.endsWith(".sources") || f.endsWith(".list")).sort()) candidates.push(join(dir, f));
  candidates.push("/etc/apt/sources.list");
  for (const file of candidates) {
    if (!existsSync(file)) continue;
    const text = readFileSync(file, "utf8");
    for (const m of text.matchAll(/^(?:URIs:\s*(\S+)|deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+bookworm\s)/gm)) {
      const uri = m[1] ?? m[2];
      if (uri && /\/debian\/?$/.test(uri)) return uri.replace(/\/$/, "");
    }
  }
  return "http://deb.debian.org/debian";
}

/**
 * Runs a build command with umask 022: what debootstrap, dpkg's maintainer scripts and apt write is the machines'
 * filesystem, readable by every user in them, while Kiln itself writes with umask 077.
 */
export function run(cmd: string, args: string[], onLine: (line: string) => void, env: NodeJS.ProcessEnv = process.env): Promise<void> {
  return new Promise((resolve, reject) => {
    const child = spawn("/bin/sh", ["-c", 'umask 022 && exec "$0" "$@"', cmd, ...args], { env, stdio: ["ignore", "pipe", "pipe"] });
    let tail = "";
    const feed = (chunk: Buffer) => {
      const text = chunk.toString();
      tail = (tail + text).slice(-4000);
      for (const line of text.split("\n")) if (line.trim()) onLine(line.trimEnd());
    };
    child.stdout.on("data", feed);
    child.stderr.on("data", feed);
    child.on("error", reject);
    child.on("close", (code) => (code === 0 ? resolve() : reject(new Error(`${cmd} ${args.slice(0, 3).join(" ")} … exited ${code}: ${tail.slice(-800)}`))));
  });
}

/** Shifts every file's owner by HOST_ID_BASE, keeping setuid/setgid bits (chown clears them). */
export async function shiftOwnership(root: string): Promise<void> {
  const stack = [root];
  while (stack.length) {
    const dir = stack.pop()!;
    const st = await lstat(dir);
    await shiftOne(dir, st);
    for (const entry of await readdir(dir, { withFileTypes: true })) {
      const p = join(dir, entry.name);
      if (entry.isDirectory()) stack.push(p);
      else await shiftOne(p, await lstat(p));
    }
  }
}

async function shiftOne(path: string, st: Awaited<ReturnType<typeof lstat>>) {
  if (Number(st.uid) >= HOST_ID_BASE) return;
  await lchown(path, Number(st.uid) + HOST_ID_BASE, Number(st.gid) + HOST_ID_BASE);
  if (!st.isSymbolicLink() && Number(st.mode) & 0o6000) await chmod(path, Number(st.mode) & 0o7777);
}

/** Whether a process holds `dir` as its root or working directory (a chroot left running by a killed server). */
function inUseBy(dir: string): number | undefined {
  for (const pid of readdirSync("/proc").filter((n) => /^\d+$/.test(n))) {
    for (const link of ["root", "cwd"]) {
      let target: string;
      try {
        target = readlinkSync(`/proc/${pid}/${link}`);
      } catch {
        continue;
      }
      if (target === dir || target.startsWith(dir + "/")) return Number(pid);
    }
  }
  return undefined;
}

/**
 * Removes `.build-<pid>-<ms>` dirs a killed server left under <cache>/<kind> (base, code-interpreter) (a kill -9 mid-debootstrap leaves 100+ MB
 * and a mounted /proc): only when their maker is dead and no process runs inside them; their mounts go first, so
 * the removal never reaches through one. Other processes sharing the cache keep their builds in progress.
 */
export async function sweepStaleBaseBuilds(cacheDir: string, log: Logger, kind = "base"): Promise<string[]> {
  const base = join(cacheDir, kind);
  const swept: string[] = [];
  for (const name of existsSync(base) ? readdirSync(base) : []) {
    const m = /^\.build-(\d+)-\d+$/.exec(name);
    if (!m) continue;
    const dir = join(base, name);
    if (pidAlive(Number(m[1]))) continue;
    const user = inUseBy(dir);
    if (user !== undefined) {
      log.warn({ dir, pid: user }, `a stale ${kind}-template build dir is still in use by a process: left for the next start`);
      continue;
    }
    const mounts = readFileSync("/proc/self/mountinfo", "utf8")
      .split("\n")
      .map((line) => line.split(" ")[4])
      .filter((point): point is string => point !== undefined && (point === dir || point.startsWith(dir + "/")))
      .sort((a, b) => b.length - a.length);
    for (const point of mounts) await run("umount", ["-l", point], () => undefined).catch(() => undefined);
    const still = readFileSync("/proc/self/mountinfo", "utf8").split("\n").some((line) => (line.split(" ")[4] ?? "").startsWith(dir + "/"));
    if (still) {
      log.warn({ dir }, `a stale ${kind}-template build dir still has mounts: left for the next start`);
      continue;
    }
    await rm(dir, { recursive: true, force: true });
    swept.push(dir);
  }
  if (swept.length) log.info({ dirs: swept }, `removed ${kind}-template build dirs a stopped server left`);
  return swept;
}

export async function ensureBaseTemplate(opts: { cacheDir: string; mirror?: string; log: Logger; onProgress?: (line: string) => void }): Promise<BaseTemplate> {
  await sweepStaleBaseBuilds(opts.cacheDir, opts.log);
  const home = join(opts.cacheDir, "base", BASE_TEMPLATE_VERSION);
  const layerDir = join(home, "layer");
  const marker = join(home, "complete.json");
  if (existsSync(marker)) {
    const { digest } = JSON.parse(await readFile(marker, "utf8")) as { digest: string };
    return { layerDir, digest, created: false };
  }
  const progress = opts.onProgress ?? ((line: string) => opts.log.info({ phase: "base-template" }, line));
  const mirror = opts.mirror ?? hostDebianMirror();
  const work = join(opts.cacheDir, "base", `.build-${process.pid}-${Date.now()}`);
  const rootfs = join(work, "layer");
  await mkdir(work, { recursive: true });
  const env = { ...process.env, DEBIAN_FRONTEND: "noninteractive", LANG: "C.UTF-8", LC_ALL: "C.UTF-8" };
  try {
    progress(`debootstrap --variant=minbase bookworm from ${mirror}`);
    await run("debootstrap", ["--variant=minbase", "bookworm", rootfs, mirror], (l) => /^I: (Retrieving|Validating|Extracting|Installing|Configuring) /.test(l) || progress(l), env);
    progress(`apt-get install ${BASE_PACKAGES.join(" ")}`);
    await mkdir(join(rootfs, "proc"), { recursive: true });
    await run("mount", ["-t", "proc", "proc", join(rootfs, "proc")], progress);
    try {
      // No daemons may start inside the chroot while packages are configured.
      await writeFile(join(rootfs, "usr/sbin/policy-rc.d"), "#!/bin/sh\nexit 101\n");
      await chmod(join(rootfs, "usr/sbin/policy-rc.d"), 0o755);
      await run("chroot", [rootfs, "apt-get", "install", "-y", "-q", "--no-install-recommends", ...BASE_PACKAGES], (l) => /^(Setting up|Unpacking) /.test(l) && progress(l), env);
      await run("chroot", [rootfs, "sh", "-c", "apt-get clean && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d /var/log/*.log /var/cache/debconf/*-old"], progress, env);
      progress("adding user `user` (uid 1000) and /workspace");
      await run("chroot", [rootfs, "useradd", "--uid", "1000", "--user-group", "--create-home", "--home-dir", "/home/user", "--shell", "/bin/bash", "user"], progress, env);
      await run("chroot", [rootfs, "install", "-d", "-o", "1000", "-g", "1000", "-m", "0755", "/workspace"], progress, env);
    } finally {
      await run("umount", ["-l", join(rootfs, "proc")], () => undefined).catch(() => undefined);
    }
    // Files the driver mounts over must exist as mount points; the build host's own resolver and names stay out.
    // Modes by hand: Kiln's own umask is 077, and these are the machines' files.
    const files: [string, string][] = [
      ["etc/resolv.conf", ""],
      ["etc/hostname", "localhost\n"],
      ["etc/hosts", "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"],
    ];
    for (const [file, text] of files) {
      await writeFile(join(rootfs, file), text);
      await chmod(join(rootfs, file), 0o644);
    }
    for (const dir of ["opt/kiln", "run/kiln"]) {
      await mkdir(join(rootfs, dir), { recursive: true });
      await chmod(join(rootfs, dir), 0o755);
    }
    progress("shifting ownership into the machines' uid range");
    await shiftOwnership(rootfs);
    const digest = "sha256:" + createHash("sha256").update(`${BASE_TEMPLATE_VERSION}\n${mirror}\n${BASE_PACKAGES.join(",")}\n${Date.now()}`).digest("hex");
    await writeFile(join(work, "complete.json"), JSON.stringify({ digest, mirror, version: BASE_TEMPLATE_VERSION, created_at: new Date().toISOString() }));
    // Another process sharing this cache may have finished first, and machines may already run on its layer:
    // never replace a complete template, only a leftover without its marker.
    if (existsSync(marker)) {
      await rm(work, { recursive: true, force: true });
      const { digest: theirs } = JSON.parse(await readFile(marker, "utf8")) as { digest: string };
      return { layerDir, digest: theirs, created: false };
    }
    await rm(home, { recursive: true, force: true });
    await rename(work, home);
    progress(`base template ready at ${layerDir}`);
    return { layerDir, digest, created: true };
  } catch (err) {
    await run("umount", ["-l", join(rootfs, "proc")], () => undefined).catch(() => undefined);
    await rm(work, { recursive: true, force: true });
    throw err;
  }
}
