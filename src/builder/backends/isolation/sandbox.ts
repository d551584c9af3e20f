// Where a Dockerfile build runs: the host objects that confine Buildah and its RUN steps, made before the builder
// starts and all removed after it, by the build itself or — after a kill -9 — by the next start of any Kiln.
//
// A build (its scratch dir's name is its key) has: a user namespace mapping 0…65535 onto host ids 1,000,000,000 +
// 0…65535, a range no machine uses; a network namespace owned by it, wired to the internet by slirp4netns in an egress
// cgroup (machines' nftables policy) or loopback only; the cgroup /kiln/builds/<key> under which every RUN container
// gets its memory, CPU and pids limits (runtime-shim.ts puts them there); a second egress cgroup the Buildah process
// itself runs in, so what it fetches for the Dockerfile (`ADD http://…`, FROM and `--from` images) is held to the same
// policy, with only the operator's KILN_INSECURE_REGISTRIES opened (address:port); and a reaper process that kills
// everything in those cgroups when the build ends — or when Kiln dies, since it waits on a pipe only Kiln holds.

import { execFile, spawn } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { existsSync, readFileSync, readdirSync, statSync } from "node:fs";
import { appendFile, chmod, mkdir, mkdtemp, readdir, rm, rmdir, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import type { Egress } from "../../../runtime/oci/egress.ts";
import { removeNetns, startSlirp, stopSlirp, SLIRP_DNS } from "../../../runtime/oci/network.ts";
import { detectCgroups } from "../../../runtime/oci/cgroups.ts";
import type { RunPolicy } from "./runtime-shim.ts";

const exec = promisify(execFile);

/** Host ids of every Dockerfile build's RUN steps: container id n is host id BUILD_HOST_ID_BASE + n. */
export const BUILD_HOST_ID_BASE = 1_000_000_000;
export const BUILD_ID_RANGE = 65_536;
/** Processes (and threads) one RUN step may have at once. */
export const BUILD_PIDS_LIMIT = 2048;
/** The cgroup (in every hierarchy) under which each build's RUN containers live. */
const BUILDS_CGROUP = "kiln/builds";
const CGROUP_ROOT = "/sys/fs/cgroup";
const SHIM = fileURLToPath(new URL("./runtime-shim.ts", import.meta.url));

export interface SandboxOptions {
  /** Names the build's host objects; the scratch dir's base name, which says which Kiln process owns it. */
  key: string;
  /** Private (0700) dir in the scratch dir for the namespaces, slirp4netns, egress markers and the shim's policy. */
  stateDir: string;
  internet: boolean;
  hostAccess: boolean;
  vcpus: number;
  memoryMb: number;
  /** address:port pairs the builder may reach although the egress policy refuses their range. */
  fetchAllow: { address: string; port: number }[];
  egress: Egress;
}

export interface Sandbox {
  /** The OCI runtime to give Buildah (`--runtime`). */
  runtime: string;
  /** `buildah bud` flags for the RUN steps' network and DNS. */
  budArgs: string[];
  /** Starts a builder command inside the build's cgroups: its processes are the build's, its sockets filtered. */
  spawn(cmd: string, args: string[], env: NodeJS.ProcessEnv): ChildProcess;
  /** Kills every process of the build (builder, RUN trees, slirp4netns); resolves once none is left. Nothing can be
   * spawned after it; calling it again kills again. */
  kill(): Promise<void>;
  /** kill(), then removes the namespaces, egress rules and cgroups. The scratch dir is the caller's. */
  close(): Promise<void>;
}

/** `<pid>.<start time>` of this process: a Kiln that reuses a dead one's pid does not own its builds. */
export function ownerTag(pid = process.pid): string | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    return `${pid}.${stat.slice(stat.lastIndexOf(")") + 2).split(" ")[19]}`;
  } catch {
    return undefined;
  }
}

/** Whether the process named by a key's owner tag (`<pid>.<start>`, or a bare pid from older Kilns) still runs. */
export function ownerAlive(tag: string): boolean {
  const [pid, start] = tag.split(".");
  const now = ownerTag(Number(pid));
  return now !== undefined && (start === undefined || now === tag);
}

function paths(stateDir: string) {
  return {
    userns: join(stateDir, "userns"),
    netns: join(stateDir, "netns"),
    slirpPid: join(stateDir, "slirp.pid"),
    slirpLog: join(stateDir, "slirp.log"),
    runEgress: join(stateDir, "egress-run.json"),
    fetchEgress: join(stateDir, "egress-fetch.json"),
    /** The cgroup dirs whose processes the reaper kills, one a line (appended as they are made). */
    reap: join(stateDir, "reap"),
    policy: join(stateDir, "policy.json"),
    runtime: join(stateDir, "runtime"),
  };
}

const egressIds = (key: string) => ({ run: `run-${key}`, fetch: `fetch-${key}` });

/**
 * Kills every process in the cgroup dirs listed in $1 (and their descendants) once stdin closes: v2 dirs by
 * cgroup.kill, v1 ones by freezing, SIGKILL and thawing, so nothing forks past it. Gives up after ~30 s.
 */
const REAPER = `cat >/dev/null
i=0
while [ $i -lt 600 ]; do
  found=
  while IFS= read -r dir; do
    [ -d "$dir" ] || continue
    pids=$(find "$dir" -name cgroup.procs -exec cat {} + 2>/dev/null)
    [ -n "$pids" ] || continue
    found=1
    if [ -f "$dir/cgroup.kill" ]; then echo 1 > "$dir/cgroup.kill"; continue; fi
    [ -f "$dir/freezer.state" ] && echo FROZEN > "$dir/freezer.state"
    kill -9 $pids 2>/dev/null
    [ -f "$dir/freezer.state" ] && echo THAWED > "$dir/freezer.state"
  done < "$1"
  [ -n "$found" ] || exit 0
  i=$((i+1))
  sleep 0.05
done
exit 1`;

/** Starts the reaper; it waits for its stdin to close (`hold: false` closes it at once: a sweep). */
function startReaper(reapFile: string, hold: boolean): { child: ChildProcess; done: Promise<boolean> } {
  const child = spawn("/bin/sh", ["-c", REAPER, "kiln-build-reaper", reapFile], { detached: true, stdio: [hold ? "pipe" : "ignore", "ignore", "ignore"] });
  const done = new Promise<boolean>((resolve) => {
    child.once("exit", (code) => resolve(code === 0));
    child.once("error", () => resolve(false));
  });
  return { child, done };
}

/** The v1 hierarchies (by controller dir) and the v2 one, as the host mounts them. */
function hierarchies(): { v1: string[]; v2: string | undefined } {
  if (existsSync(`${CGROUP_ROOT}/cgroup.controllers`)) return { v1: [], v2: CGROUP_ROOT };
  const v1 = readdirSync(CGROUP_ROOT).filter((d) => d !== "unified" && existsSync(join(CGROUP_ROOT, d, "cgroup.procs")) && !statSync(join(CGROUP_ROOT, d)).isSymbolicLink());
  return { v1: v1.map((d) => join(CGROUP_ROOT, d)), v2: existsSync(`${CGROUP_ROOT}/unified/cgroup.controllers`) ? `${CGROUP_ROOT}/unified` : undefined };
}

/** Where a build's processes can all be found and killed at once: the freezer hierarchy on v1, else v2. */
function killRoot(key: string): string | undefined {
  const h = hierarchies();
  if (h.v1.length) return existsSync(`${CGROUP_ROOT}/freezer/cgroup.procs`) ? join(CGROUP_ROOT, "freezer", BUILDS_CGROUP, key) : undefined;
  return h.v2 ? join(h.v2, BUILDS_CGROUP, key) : undefined;
}

/** Removes a build's cgroup tree, deepest first, in every hierarchy (only empty cgroups can go). */
async function removeCgroupTree(key: string): Promise<void> {
  const h = hierarchies();
  const roots = [...h.v1, ...(h.v2 ? [h.v2] : [])].map((r) => join(r, BUILDS_CGROUP, key));
  const remove = async (dir: string): Promise<void> => {
    const entries = await readdir(dir, { withFileTypes: true }).catch(() => []);
    await Promise.all(entries.filter((e) => e.isDirectory()).map((e) => remove(join(dir, e.name))));
    for (let i = 0; i < 100; i++) {
      try {
        await rmdir(dir);
        return;
      } catch (err) {
        const code = (err as NodeJS.ErrnoException).code;
        if (code === "ENOENT") return;
        // A killed process leaves its cgroup a moment after it is reaped.
        if (code !== "EBUSY" || i === 99) return;
        await new Promise((r) => setTimeout(r, 20));
      }
    }
  };
  await Promise.all(roots.map(remove));
}

/**
 * A user namespace mapped onto the build range and a network namespace it owns (so RUN steps can mount their own
 * sysfs), kept by bind mounts on two files; the process that made them is gone when this returns.
 */
async function makeNamespaces(userns: string, netns: string): Promise<void> {
  await writeFile(userns, "", { mode: 0o600 });
  await writeFile(netns, "", { mode: 0o600 });
  const holder = spawn("unshare", ["--user", "--net", "/bin/sh", "-c", "echo ready; exec sleep 60"], { stdio: ["ignore", "pipe", "ignore"] });
  try {
    await new Promise<void>((resolve, reject) => {
      holder.stdout!.once("data", () => resolve());
      holder.once("error", reject);
      holder.once("exit", (code) => reject(new Error(`unshare exited ${code}`)));
    });
    const map = `0 ${BUILD_HOST_ID_BASE} ${BUILD_ID_RANGE}\n`;
    await writeFile(`/proc/${holder.pid}/uid_map`, map);
    await writeFile(`/proc/${holder.pid}/gid_map`, map);
    await exec("mount", ["--bind", `/proc/${holder.pid}/ns/user`, userns]);
    await exec("mount", ["--bind", `/proc/${holder.pid}/ns/net`, netns]);
  } catch (err) {
    throw new Error(`the build's namespaces could not be made: ${(err as Error).message}`);
  } finally {
    holder.kill("SIGKILL");
  }
}

/** The sandbox of one build; everything it makes is listed in `stateDir` so a later start can undo it. */
export async function openSandbox(o: SandboxOptions): Promise<Sandbox> {
  const p = paths(o.stateDir);
  const ids = egressIds(o.key);
  await writeFile(p.reap, "", { mode: 0o600 });
  // First the reaper, so nothing the build starts can outlive Kiln.
  const reaper = startReaper(p.reap, true);
  // Once killed, the sandbox starts nothing more; a second kill sweeps again (the reaper that waited has exited).
  let killed = false;
  let killing = Promise.resolve();
  const kill = () => {
    const first = !killed;
    killed = true;
    killing = killing.then(async () => {
      if (first) (reaper.child.stdin as NodeJS.WritableStream | null)?.end();
      if (!first || !(await reaper.done)) await startReaper(p.reap, false).done;
    });
    return killing;
  };
  const builderProcs: string[] = [];
  try {
    const root = killRoot(o.key);
    if (!root) throw new Error("no freezer or cgroup v2 hierarchy: a build's processes could not all be killed");
    await mkdir(root, { recursive: true });
    await appendFile(p.reap, root + "\n");
    // The builder joins the build's cgroup where v1 hierarchies allow a second membership beside its egress one.
    const h = hierarchies();
    for (const dir of h.v1.filter((d) => /\/(freezer|pids)$/.test(d))) {
      const builder = join(dir, BUILDS_CGROUP, o.key, "builder");
      await mkdir(builder, { recursive: true });
      builderProcs.push(join(builder, "cgroup.procs"));
    }
    await makeNamespaces(p.userns, p.netns);
    if (o.internet) {
      const procs = await o.egress.prepare(ids.run, o.hostAccess, undefined, p.runEgress);
      await appendFile(p.reap, procs.replace(/\/cgroup\.procs$/, "") + "\n");
      await startSlirp({ target: { netnsPath: p.netns }, hostAccess: o.hostAccess, pidFile: p.slirpPid, logFile: p.slirpLog, cgroupProcs: procs });
    } else {
      await exec("nsenter", [`--net=${p.netns}`, "ip", "link", "set", "lo", "up"]);
    }
    const fetchProcs = await o.egress.prepare(ids.fetch, o.hostAccess, undefined, p.fetchEgress, o.fetchAllow);
    await appendFile(p.reap, fetchProcs.replace(/\/cgroup\.procs$/, "") + "\n");
    builderProcs.push(fetchProcs);

    const cgroups = detectCgroups();
    const policy: RunPolicy = {
      userns: p.userns,
      netns: p.netns,
      idMap: { containerID: 0, hostID: BUILD_HOST_ID_BASE, size: BUILD_ID_RANGE },
      cgroupParent: `/${BUILDS_CGROUP}/${o.key}`,
      memoryBytes: o.memoryMb * 1024 * 1024,
      limitSwap: existsSync(`${CGROUP_ROOT}/memory/memory.memsw.limit_in_bytes`) || (cgroups.version === "v2" && cgroups.enforced.includes("memory")),
      cpuQuota: Math.round(o.vcpus * 100_000),
      cpuPeriod: 100_000,
      pidsLimit: BUILD_PIDS_LIMIT,
    };
    await writeFile(p.policy, JSON.stringify(policy), { mode: 0o600 });
    // runc for everything but `create`, whose spec the shim fits to the sandbox first (runtime-shim.ts).
    const wrapper = `#!/bin/sh\nfor a; do if [ "$a" = create ]; then ${sq(process.execPath)} ${sq(SHIM)} ${sq(p.policy)} "$@" || exit 1; break; fi; done\nexec runc "$@"\n`;
    await writeFile(p.runtime, wrapper, { mode: 0o700 });
    await chmod(p.runtime, 0o700);
  } catch (err) {
    await kill();
    await release(o.key, o.stateDir, o.egress);
    throw err;
  }

  return {
    runtime: p.runtime,
    budArgs: ["--network", `ns:${p.netns}`, "--dns", o.internet ? SLIRP_DNS : "none"],
    spawn(cmd, args, env) {
      if (killed) throw new Error("the build was stopped");
      // A shell moves itself into the build's cgroups, then becomes the command: nothing runs outside them.
      // umask 022: what the builder makes for RUN steps (bundles, mount points) must be traversable from inside the
      // build's user namespace, whatever Kiln's own umask is.
      const join = 'umask 022; n=$1; shift; while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"';
      return spawn("/bin/sh", ["-c", join, "kiln-build", String(builderProcs.length), ...builderProcs, cmd, ...args], { env, stdio: ["ignore", "pipe", "pipe"] });
    },
    kill,
    async close() {
      await (killed ? killing : kill());
      await release(o.key, o.stateDir, o.egress);
    },
  };
}

function sq(s: string): string {
  return `'${s.replace(/'/g, `'\\''`)}'`;
}

/** Undoes what openSandbox made (its processes already killed): slirp4netns, egress rules, namespaces, cgroups. */
async function release(key: string, stateDir: string, egress: Egress): Promise<void> {
  const p = paths(stateDir);
  const ids = egressIds(key);
  await stopSlirp(p.slirpPid);
  // Independent of each other once the build's processes are gone.
  await Promise.all([
    egress.release(ids.run, p.runEgress).catch(() => undefined),
    egress.release(ids.fetch, p.fetchEgress).catch(() => undefined),
    removeNetns(p.netns),
    removeNetns(p.userns),
    removeCgroupTree(key),
  ]);
}

/** Where egress.ts keeps its cgroups (`kiln-egress/<group>/<id>`): found by name when a build's markers are gone. */
const EGRESS_ROOTS = [`${CGROUP_ROOT}/unified/kiln-egress`, `${CGROUP_ROOT}/kiln-egress`];
const EGRESS_GROUPS = ["isolated", "host-access"];

function egressDirs(key: string): { id: string; group: string; dir: string }[] {
  const ids = egressIds(key);
  const out = [];
  for (const root of EGRESS_ROOTS) for (const group of EGRESS_GROUPS) for (const id of [ids.run, ids.fetch]) if (existsSync(join(root, group, id))) out.push({ id, group, dir: join(root, group, id) });
  return out;
}

/** Egress cgroups and rules of a dead build whose markers are lost: released as if their markers said so. */
async function releaseOrphanEgress(key: string, egress: Egress): Promise<void> {
  const found = egressDirs(key);
  if (!found.length) return;
  const tmp = await mkdtemp(join(tmpdir(), "kiln-egress-"));
  try {
    for (const { id, group } of found) {
      const marker = join(tmp, id);
      await writeFile(marker, JSON.stringify({ group, rules: true }));
      await egress.release(id, marker).catch(() => undefined);
    }
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
}

/** Kills every process in `dirs` (cgroup dirs and their descendants) and waits until none is left. */
async function reap(dirs: string[]): Promise<void> {
  const tmp = await mkdtemp(join(tmpdir(), "kiln-reap-"));
  try {
    await writeFile(join(tmp, "reap"), dirs.map((d) => d + "\n").join(""), { mode: 0o600 });
    await startReaper(join(tmp, "reap"), false).done;
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
}

const deadOwner = (key: string) => {
  const owner = /^bld-(\d+(?:\.\d+)?)-/.exec(key)?.[1];
  return owner !== undefined && !ownerAlive(owner);
};

/**
 * What builds of dead Kilns left: for each scratch dir under `scratchParent` whose owner is gone, its processes are
 * killed and its namespaces, egress rules and cgroups removed (the caller then removes the dir). Build and egress
 * cgroups of dead owners found elsewhere on the host (another data dir, or markers lost) lose their processes and
 * go too. Returns the dead builds' names under `scratchParent`.
 */
export async function sweepSandboxes(scratchParent: string, egress: Egress): Promise<string[]> {
  const dead: string[] = [];
  for (const name of await readdir(scratchParent).catch(() => [] as string[])) {
    if (!deadOwner(name)) continue;
    const stateDir = join(scratchParent, name, "state");
    if (existsSync(join(stateDir, "reap"))) {
      await startReaper(join(stateDir, "reap"), false).done;
      await release(name, stateDir, egress);
    }
    dead.push(name);
  }
  const orphans = new Set<string>(dead);
  const root = killRoot("");
  for (const key of root ? await readdir(root).catch(() => [] as string[]) : []) if (deadOwner(key)) orphans.add(key);
  for (const base of EGRESS_ROOTS) {
    for (const group of EGRESS_GROUPS) {
      for (const id of await readdir(join(base, group)).catch(() => [] as string[])) {
        const key = /^(?:run|fetch)-(bld-.+)$/.exec(id)?.[1];
        if (key && deadOwner(key)) orphans.add(key);
      }
    }
  }
  for (const key of orphans) {
    const dirs = [...(root ? [join(root, key)] : []), ...egressDirs(key).map((e) => e.dir)].filter((d) => existsSync(d));
    if (dirs.length) await reap(dirs);
    await releaseOrphanEgress(key, egress);
    await removeCgroupTree(key);
  }
  return dead;
}
