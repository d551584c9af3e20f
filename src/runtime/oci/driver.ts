// The `oci` MachineDriver: each machine is an OCI bundle (overlayfs root over the template's read-only layers)
// run by runc — or gVisor's runsc — under a Kiln-owned state root, so `list` sees only Kiln's machines.
// Long on purpose: one machine's lifecycle against runc/runsc (create, hibernate, resume, heal, destroy) in one place;
// disks, egress, identity, network and spec already live in their own files beside it.

import { execHost, runHost } from "../host-commands.ts";
import { connect, createServer } from "node:net";
import type { Server } from "node:net";
import { get as httpGet } from "node:http";
import { existsSync, statSync, chmodSync, readFileSync, writeFileSync } from "node:fs";
import { chmod, chown, link, mkdir, open, readdir, readFile, rm, writeFile } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import { DEFAULT_DISK_MB } from "../driver.ts";
import type { DriverReadiness, HibernateMode, LiveMachine, MachineCheckpoint, MachineDriver, MachineHealth, MachineSpec, SavedSnapshot } from "../driver.ts";
import type { Logger } from "../../log.ts";
import { guestRuntimeComplete } from "../guest-runtime.ts";
import { CANONICAL_BASE } from "./idmap.ts";
import { createMachineIdentities, scratchDir } from "./identity.ts";
import { AGENT_SOCKET_NAME, machineNofileSoft, machineSpec } from "./spec.ts";
import { applyHostLimits, cgroupFreezer, defaultHostLimits, detectCgroups, KILN_CGROUP, killCgroup, removeCgroups, setMachineLimits } from "./cgroups.ts";
import type { HostLimits } from "./cgroups.ts";
import { isMounted } from "./mounts.ts";
import { machineUsage } from "./usage.ts";
import { HOST_ALIAS, SLIRP_DNS, SLIRP_GATEWAY, makeNetns, quickAckLoopback, removeNetns, slirpAlive, startSlirp, stopSlirp } from "./network.ts";
import { trimLog } from "./health.ts";
import { createDiskStock, mountWritableLayer, unmountWritableLayer, writableLayer } from "./disk.ts";
import type { DiskStock } from "./disk.ts";
import { openDiskPool } from "./disk-pool.ts";
import type { DiskPool, DiskPoolMode } from "./disk-pool.ts";
import type { FreezeHooks } from "./snapshot.ts";
import { allocatedBytes, copyLiveDisk, copySnapshotLayer, sweepSnapshotReads, thawInterrupted } from "./snapshot.ts";
import { createSnapshotSpares } from "./snapshot-spares.ts";
import { createEgress } from "./egress.ts";
import { createRuntimeCli, RUNSC_MIN_RELEASE } from "./runtime-cli.ts";
import { pidAlive } from "../pid-alive.ts";
import { clearStepMemory, endStepProcesses } from "./build-steps.ts";

export { HOST_ID_BASE, ID_RANGE } from "./idmap.ts";
export { containerName } from "./runtime-cli.ts";

// Started by the host command helper, not by the server's own thread (host-commands.ts).
const exec = execHost;

const AGENT_WAIT_MS = 15_000;
/** runsc: how long the agent may take to let go of its socket before a checkpoint (see agent/main.ts). */
const LET_GO_WAIT_MS = 5_000;
/** The file whose appearance in the bound run dir tells a restored agent to listen again (agent/main.ts). */
const RELISTEN_FILE = "relisten";
const PIDS_LIMIT = 4096;
/** Disks of the default size kept formatted and mounted, so a create waits for neither mkfs nor mount. */
const SPARE_DISKS = 3;
/**
 * runsc: memory snapshots whose disk is kept copied and mounted ahead by default, so a machine restored from one takes
 * it with two renames (snapshot-spares.ts). Each holds a loop device.
 */
const SNAPSHOT_SPARES = 4;
/** Machine ids become path components and runtime ids: nothing but these characters. */
const SAFE_ID = /^[A-Za-z0-9][A-Za-z0-9_-]{0,100}$/;
/** One per host: every Kiln server on it takes machines' uid ranges from the same pool. */
const DEFAULT_ID_RANGES_DIR = "/var/lib/kiln/id-ranges";
/**
 * In a machine's dir: the machine is being destroyed (its processes were killed; the rest is being removed). It goes
 * with the dir; a start finds it on what a crash cut short and finishes the destroy (the dir has no live record).
 */
const GOING_MARKER = "destroying";
/** In a build machine's dir: the name of the upper dir on its disk its root writes to now, once renewLayer gave it one. */
const UPPER_FILE = "upper";
const UPPER_NAME = /^upper-(\d{1,4})$/;

export interface OciDriverOptions {
  dataDir: string;
  runtime: "runc" | "runsc";
  /** runsc only; default ptrace, which started machines and ran processes fastest on the hosts measured. */
  runscPlatform?: "ptrace" | "systrap" | "kvm";
  hostAccess: boolean;
  log: Logger;
  guestRuntimeDir: string;
  /** `auto` (default): each machine on its own host ids where the host allows; `shared`: all on one range. */
  identity?: "auto" | "shared";
  /** Where the mount helper is compiled (default `<dataDir>/cache/bin`); servers sharing a cache share it. */
  helperDir?: string;
  /** The host-wide claims of machines' uid ranges (default /var/lib/kiln/id-ranges): one per host, not per server. */
  idRangesDir?: string;
  /** Caps on all machines together (Kiln's parent cgroup); each one not given comes from defaultHostLimits(). */
  hostLimits?: Partial<HostLimits>;
  /**
   * `auto`: machines' disks and snapshots on a filesystem that can reflink (an XFS file in the data dir when its own
   * cannot); `off` (default here, `auto` in the server's config): plain copies. See disk-pool.ts.
   */
  diskPool?: DiskPoolMode;
  /** runsc: memory snapshots whose disk is kept copied and mounted ahead (default 4; snapshot-spares.ts). */
  snapshotSpares?: number;
}

/** Where a machine's disk image is: in the disk pool, or beside its mount point for a machine made before the pool. */
function machineImage(dataDir: string, machineDir: string, id: string): string {
  const legacy = join(machineDir, "disk", "disk.img");
  return existsSync(legacy) ? legacy : join(dataDir, "disks", "machines", `${id}.img`);
}

type Paths = ReturnType<typeof machinePaths>;

function machinePaths(dataDir: string, machinesDir: string, id: string, runtime: "runc" | "runsc") {
  if (!SAFE_ID.test(id)) throw new Error(`invalid machine id ${JSON.stringify(id)}`);
  const dir = join(machinesDir, id);
  const layer = writableLayer(dir, machineImage(dataDir, dir, id));
  return {
    dir,
    rootfs: join(dir, "rootfs"),
    layer,
    /** Where the machine's egress cgroup is and whether it has nftables rules of its own. */
    egress: join(dir, "egress.json"),
    run: join(dir, "run"),
    etc: join(dir, "etc"),
    // runc: a host-only path (the listening socket is handed to the agent); runsc: inside the bound run dir.
    socket: runtime === "runc" ? join(dir, AGENT_SOCKET_NAME) : join(dir, "run", AGENT_SOCKET_NAME),
    spec: join(dir, "machine.json"),
    // On the machine's own disk image: what its processes write there can never pass the disk_mb it was given
    // (and health.ts trims it to its cap).
    log: join(layer.mountPoint, "runtime.log"),
    pidFile: join(dir, "runtime.pid"),
    slirpPid: join(dir, "slirp.pid"),
    slirpLog: join(dir, "slirp.log"),
    /** runsc only: the machine's network namespace, made and wired before the sandbox starts. */
    netns: join(dir, "netns"),
    /** runsc only: the checkpoint of a machine hibernated with its memory, consumed by its resume. */
    hibernation: join(dir, "hibernation"),
  };
}

/** The host's open-file hard limit: machine root cannot be given more than the process that starts it has. */
function hostNofile(): number {
  const m = /^Max open files\s+\S+\s+(\S+)/m.exec(readFileSync("/proc/self/limits", "utf8"));
  const hard = m && m[1] !== "unlimited" ? Number(m[1]) : 1_048_576;
  return Math.min(hard, 1_048_576);
}

/** Bytes the files under `dir` take on disk. */
async function dirBytes(dir: string): Promise<number> {
  let total = 0;
  for (const entry of await readdir(dir, { withFileTypes: true, recursive: true })) {
    if (entry.isFile()) total += statSync(join(entry.parentPath, entry.name)).blocks * 512;
  }
  return total;
}

/**
 * Reads a checkpoint's files once so they are in the page cache (runsc writes them with O_DIRECT): the restore that
 * follows reads memory, not the disk. Best effort: a restore reads them anyway.
 */
async function readAhead(dir: string): Promise<void> {
  const buf = Buffer.allocUnsafe(1024 * 1024);
  try {
    for (const entry of await readdir(dir, { withFileTypes: true })) {
      if (!entry.isFile()) continue;
      const fh = await open(join(dir, entry.name), "r");
      try {
        while ((await fh.read(buf, 0, buf.length, null)).bytesRead > 0);
      } finally {
        await fh.close();
      }
    }
  } catch {
    // as above
  }
}

async function tail(file: string, chars = 800): Promise<string> {
  const text = await readFile(file, "utf8").catch(() => "");
  return text.trim().slice(-chars);
}

/**
 * A listening unix socket made on the host for the agent to inherit. The path the control plane connects to is a
 * hard link made before the host closes its copy (closing unlinks the name it was bound to, not the link).
 */
async function hostListener(path: string): Promise<{ server: Server; close(): Promise<void> }> {
  const bound = `${path}.bind`;
  await rm(bound, { force: true });
  await rm(path, { force: true });
  const server = createServer();
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen({ path: bound, backlog: 511 }, () => resolve());
  });
  await link(bound, path);
  return { server, close: () => new Promise<void>((resolve) => server.close(() => resolve())) };
}

/** True when an agent answers GET /health on the socket within `timeoutMs`. */
function answersHealth(socketPath: string, timeoutMs: number): Promise<boolean> {
  return new Promise((resolve) => {
    const req = httpGet({ socketPath, path: "/health", timeout: timeoutMs, agent: false }, (res) => {
      res.resume();
      resolve(res.statusCode === 200);
    });
    req.on("timeout", () => req.destroy());
    req.on("error", () => resolve(false));
  });
}

function canConnect(socket: string): Promise<boolean> {
  return new Promise((resolve) => {
    const s = connect(socket);
    s.once("connect", () => {
      s.destroy();
      resolve(true);
    });
    s.once("error", () => {
      s.destroy();
      resolve(false);
    });
  });
}

/**
 * A killed machine's first process stays a zombie until the host's init reaps it; runsc counts that as running.
 * (runc does not.) Either way it is dead.
 */
function isZombie(pid: number): boolean {
  try {
    return readFileSync(`/proc/${pid}/stat`, "utf8").replace(/^.*\) /s, "").startsWith("Z");
  } catch {
    return false;
  }
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

export function createOciDriver(opts: OciDriverOptions): MachineDriver {
  const machinesDir = join(opts.dataDir, "machines");
  const stateRoot = join(opts.dataDir, "oci-state", opts.runtime);
  const cgroups = detectCgroups();
  const nofile = hostNofile();
  const paths = (id: string) => machinePaths(opts.dataDir, machinesDir, id, opts.runtime);
  const cli = createRuntimeCli({ runtime: opts.runtime, stateRoot, runscPlatform: opts.runscPlatform });
  const passFd = opts.runtime === "runc";
  // Disks are stored in the canonical range like every file at rest; a machine on its own range sees them idmapped.
  // The disk pool is opened on first use; spare disks keep their images in it, so handing one out is two renames.
  let poolOpening: Promise<{ pool: DiskPool; disks: DiskStock }> | undefined;
  const storage = () =>
    (poolOpening ??= openDiskPool({ dataDir: opts.dataDir, mode: opts.diskPool ?? "off", log: opts.log, helper: () => identities.helperPath() }).then(async (pool) => {
      await Promise.all([mkdir(join(pool.dir, "machines"), { recursive: true }), mkdir(join(pool.dir, "snapshots"), { recursive: true })]);
      const disks = createDiskStock({ dir: join(opts.dataDir, "disk-stock"), imagesDir: join(pool.dir, "stock"), sizeMb: DEFAULT_DISK_MB, count: SPARE_DISKS, owner: CANONICAL_BASE, log: opts.log });
      return { pool, disks };
    }));
  // Ready copies of memory snapshots' disks (runsc: only it restores memory).
  const snapshotSpares = createSnapshotSpares({
    dir: join(opts.dataDir, "snapshot-spares"),
    pool: async () => (await storage()).pool,
    owner: CANONICAL_BASE,
    max: opts.runtime === "runsc" ? (opts.snapshotSpares ?? SNAPSHOT_SPARES) : 0,
    log: opts.log,
  });
  /** The snapshot a disk image in the snapshots dir belongs to (its directory's name). */
  const snapshotOf = (disk: string) => {
    const id = basename(dirname(disk));
    return SAFE_ID.test(id) && dirname(dirname(disk)) === join(opts.dataDir, "disks", "snapshots") ? id : undefined;
  };
  const snapshotDir = (snapshotId: string) => {
    if (!SAFE_ID.test(snapshotId)) throw new Error(`invalid snapshot id ${JSON.stringify(snapshotId)}`);
    return join(opts.dataDir, "disks", "snapshots", snapshotId);
  };
  const identities = createMachineIdentities({
    runtime: opts.runtime,
    mode: opts.identity ?? "auto",
    helperDir: opts.helperDir ?? join(opts.dataDir, "cache", "bin"),
    rangesDir: opts.idRangesDir ?? DEFAULT_ID_RANGES_DIR,
    probeDirs: [opts.dataDir],
    log: opts.log,
  });
  const egress = createEgress();
  const limitSwap = existsSync("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes") || (cgroups.version === "v2" && cgroups.enforced.includes("memory"));
  let readinessCache: { at: number; value: DriverReadiness } | undefined;
  // All machines together stay below the host's pid_max and memory: written once, before the first machine boots.
  const hostLimits: HostLimits = { ...defaultHostLimits(), ...Object.fromEntries(Object.entries(opts.hostLimits ?? {}).filter(([, v]) => v !== undefined)) };
  const hostLimitsApplied = applyHostLimits(cgroups, hostLimits).then(
    (problems) => {
      if (problems.length) opts.log.warn({ problems }, "the host-wide caps on machines could not all be set");
      else opts.log.debug({ pids_max: hostLimits.pidsMax, memory_bytes: hostLimits.memoryBytes }, "host-wide caps on machines set");
    },
    (err: unknown) => opts.log.warn({ err }, "the host-wide caps on machines could not be set"),
  );

  /** Machine root (host uid 100000+) must be able to reach its bundle: give the data dirs o+x if they lack it. */
  function ensureTraversable(dir: string) {
    const st = statSync(dir);
    if ((st.mode & 0o001) === 0) chmodSync(dir, st.mode | 0o111);
  }

  /**
   * Mounts the machine's disk and, unless the mount helper does it in front of the runtime (`viaHelper`), its overlay
   * root. Resolves to whether the overlay is still to be mounted.
   */
  async function mountRoot(spec: MachineSpec, p: Paths, viaHelper: boolean): Promise<boolean> {
    if (isMounted(p.rootfs)) return false;
    const { disks } = await storage();
    await Promise.all([mkdir(p.rootfs, { recursive: true }), mountWritableLayer(p.layer, spec.diskMb ?? DEFAULT_DISK_MB, CANONICAL_BASE, disks)]);
    for (const layer of spec.layers) if (!existsSync(layer)) throw new Error(`template layer ${layer} is missing`);
    if (viaHelper) return true;
    const lower = [...spec.layers].reverse().join(":"); // overlayfs lists the highest layer first
    try {
      await exec("mount", ["-t", "overlay", "overlay", "-o", `lowerdir=${lower},upperdir=${p.layer.upper},workdir=${p.layer.work}`, p.rootfs]);
    } catch (err) {
      throw new Error(`mounting the root of ${spec.id} failed: ${((err as { stderr?: string }).stderr || (err as Error).message).trim()}`);
    }
    return false;
  }

  async function unmountRoot(p: Paths) {
    await identities.unmountLeftovers(p.dir);
    if (existsSync(p.rootfs) && isMounted(p.rootfs)) {
      await exec("umount", [p.rootfs]).catch(() => exec("umount", ["-l", p.rootfs]));
      if (isMounted(p.rootfs)) throw new Error(`${p.rootfs} is still mounted`);
    }
    await unmountWritableLayer(p.layer);
  }

  /** A build machine's last upper and work dirs, being removed once its root was renewed (awaited before its disk goes). */
  const removals = new Map<string, Promise<void>>();

  /** The upper and work dirs the machine's root writes to now: `upper`/`work` at boot, a new pair per renewLayer. */
  async function currentUpper(p: Paths): Promise<{ n: number; upper: string; work: string }> {
    const name = (await readFile(join(p.dir, UPPER_FILE), "utf8").catch(() => "")).trim();
    if (!name) return { n: 0, upper: p.layer.upper, work: p.layer.work };
    const n = UPPER_NAME.exec(name)?.[1];
    if (!n) throw new Error(`${join(p.dir, UPPER_FILE)} names no upper dir`);
    return { n: Number(n), upper: join(p.layer.mountPoint, name), work: join(p.layer.mountPoint, `work-${n}`) };
  }

  /** Copies a writable layer's upper dir out as a template layer (ownership already in the machines' range, whiteouts and opaque xattrs kept). */
  async function copyUpper(id: string, upper: string, destDir: string): Promise<void> {
    await mkdir(destDir, { recursive: true });
    try {
      await exec("cp", ["-a", "--preserve=all", `${upper}/.`, destDir], { maxBuffer: 1024 * 1024 });
    } catch (err) {
      await rm(destDir, { recursive: true, force: true });
      throw new Error(`taking the layer of ${id} failed: ${((err as { stderr?: string }).stderr || (err as Error).message).trim()}`);
    }
  }

  /** The first process of a running machine, from its pid file. */
  async function firstPid(id: string, p: Paths): Promise<number> {
    const pid = Number(await readFile(p.pidFile, "utf8").catch(() => ""));
    if (!Number.isSafeInteger(pid) || pid <= 1 || !pidAlive(pid) || isZombie(pid)) throw new Error(`machine ${id} has no first process`);
    return pid;
  }

  /**
   * runc: the step's processes killed (every one but tini and the agent, frozen first), then its upper dir copied
   * while the overlay stays mounted: nothing writes to it any more, and what the killed processes wrote is in the
   * page cache the copy reads.
   */
  async function copyLayer(id: string, destDir: string): Promise<void> {
    const p = paths(id);
    const init = await firstPid(id, p);
    const freezer = cgroupFreezer(cgroups, `${KILN_CGROUP}/${id}`);
    if (!freezer) throw new Error(`the processes of ${id} cannot be frozen on this host`);
    const t0 = performance.now();
    const dir = cgroups.version === "v2" ? join("/sys/fs/cgroup", KILN_CGROUP, id) : join("/sys/fs/cgroup/freezer", KILN_CGROUP, id);
    const { killed } = await endStepProcesses({ freezer, dir, init });
    await clearStepMemory(init);
    const tKilled = performance.now();
    await copyUpper(id, (await currentUpper(p)).upper, destDir);
    const ms = (a: number, b: number) => Math.round((b - a) * 10) / 10;
    opts.log.debug({ machine_id: id, killed, kill_ms: ms(t0, tKilled), copy_ms: ms(tKilled, performance.now()) }, "build step's layer copied");
  }

  /**
   * runc: a new upper and work dir on the machine's own disk, and the mount helper mounts the overlay root again over
   * `layers` with them and pivots the machine onto it (as takeSnapshotDisk, without another disk). The last upper dir
   * goes behind it: nothing mounts it once the old root is detached (its processes are gone: copyLayer).
   */
  async function renewLayer(id: string, layers: string[]): Promise<void> {
    const t0 = performance.now();
    const p = paths(id);
    const [spec, ids, cur] = await Promise.all([readSpec(id), identities.read(p.dir), currentUpper(p)]);
    if (!identities.usesHelper(ids)) throw new Error(`machine ${id} does not boot through the mount helper: its root cannot be swapped`);
    for (const layer of layers) if (!existsSync(layer)) throw new Error(`template layer ${layer} is missing`);
    const init = await firstPid(id, p);
    const n = cur.n + 1;
    const next = { upper: `upper-${n}`, work: `work-${n}` };
    const upper = join(p.layer.mountPoint, next.upper);
    const work = join(p.layer.mountPoint, next.work);
    await Promise.all([rm(upper, { recursive: true, force: true }), rm(work, { recursive: true, force: true })]);
    await Promise.all([mkdir(upper), mkdir(work)]);
    // As mountWritableLayer makes the first: the merged root's top dir takes its owner and mode from the upper dir.
    await chmod(upper, 0o755);
    await chown(upper, CANONICAL_BASE, CANONICAL_BASE);
    await identities.swapRoot(ids, { dir: p.dir, layers, disk: p.layer.mountPoint, rootfs: p.rootfs, upper: next }, init);
    await Promise.all([writeFile(join(p.dir, UPPER_FILE), next.upper), writeFile(p.spec, JSON.stringify({ ...spec, layers }))]);
    const before = removals.get(id) ?? Promise.resolve();
    removals.set(
      id,
      before
        .then(() => Promise.all([rm(cur.upper, { recursive: true, force: true }), rm(cur.work, { recursive: true, force: true })]))
        .then(
          () => undefined,
          (err: unknown) => opts.log.warn({ err, machine_id: id }, "removing a build step's upper dir failed"),
        ),
    );
    opts.log.debug({ machine_id: id, layers: layers.length, renewed_ms: Math.round((performance.now() - t0) * 10) / 10 }, "build machine's root renewed");
  }

  /** Waits for the removal of a build machine's last upper dir before its disk goes. */
  async function settleRemovals(id: string): Promise<void> {
    const pending = removals.get(id);
    if (!pending) return;
    await pending;
    removals.delete(id);
  }

  async function writeEtc(spec: MachineSpec, p: Paths) {
    await mkdir(p.etc, { recursive: true });
    await chmod(p.etc, 0o711);
    const hosts = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", `127.0.1.1\t${spec.hostname}`];
    if (opts.hostAccess && spec.internet) hosts.push(`${SLIRP_GATEWAY}\t${HOST_ALIAS}`);
    // Bound into the machine, where every user reads them (Kiln's umask would leave them 0600).
    const files: [string, string][] = [
      ["hosts", hosts.join("\n") + "\n"],
      ["hostname", spec.hostname + "\n"],
      ["resolv.conf", spec.internet ? `nameserver ${SLIRP_DNS}\noptions edns0\n` : ""],
    ];
    await Promise.all(files.map(([name, text]) => writeFile(join(p.etc, name), text).then(() => chmod(join(p.etc, name), 0o644))));
  }

  /**
   * Resolves once the agent accepts a connection. Polls every millisecond (a connect to a missing socket costs
   * microseconds) because startup latency is the point; gives up early, with the runtime's log, if pid 1 dies.
   */
  async function waitForAgent(p: Paths, id: string, pid: () => number | undefined): Promise<void> {
    const deadline = performance.now() + AGENT_WAIT_MS;
    let nextLivenessCheck = performance.now() + 50;
    for (;;) {
      // A passed-in socket accepts connections before the agent runs: only an answer to /health means ready.
      if (passFd ? await answersHealth(p.socket, 50) : await canConnect(p.socket)) return;
      const now = performance.now();
      const first = pid();
      if (first && now > nextLivenessCheck) {
        nextLivenessCheck = now + 50;
        if (!pidAlive(first)) throw new Error(`the first process of ${id} exited before its agent answered: ${await tail(p.log)}`);
      }
      if (now > deadline) throw new Error(`the guest agent of ${id} did not answer within ${AGENT_WAIT_MS} ms: ${await tail(p.log)}`);
      await sleep(1);
    }
  }

  /**
   * Writes the bundle's config.json afresh (the guest runtime may have been rebuilt since) and runs it; with
   * `restoreImage` (runsc), continues the processes saved there instead of starting the first one; `rename` when the
   * image was saved from another machine (its kernel still carries that machine's hostname).
   */
  async function boot(spec: MachineSpec, restoreImage?: string, rename = false): Promise<LiveMachine> {
    await hostLimitsApplied;
    const t0 = performance.now();
    const p = paths(spec.id);
    const ids = await identities.read(p.dir);
    const viaHelper = identities.usesHelper(ids);
    // On its own range a machine sees volumes through idmapped copies the helper attaches in its dir.
    const binds = ids.idmapped ? spec.mounts.map((m, i) => ({ source: m.hostPath, target: join(scratchDir(p.dir), `v${i}`), readOnly: m.readOnly === true })) : [];
    if (viaHelper) {
      await mkdir(scratchDir(p.dir), { recursive: true });
      await chmod(scratchDir(p.dir), 0o711);
    }
    // runsc takes its network from a namespace that is already wired when the sandbox starts. (A fresh machine has
    // none yet; start() released the last boot's before calling here.)
    const netnsFirst = opts.runtime === "runsc" && spec.internet;
    // The machine's egress cgroup (and its own rules, if any) exist before slirp4netns opens a single socket.
    const egressCgroup = spec.internet ? egress.prepare(spec.id, opts.hostAccess, spec.network, p.egress) : undefined;
    egressCgroup?.catch(() => undefined);
    if (netnsFirst) {
      await makeNetns(p.netns);
      await startSlirp({ target: { netnsPath: p.netns }, hostAccess: opts.hostAccess, pidFile: p.slirpPid, logFile: p.slirpLog, cgroupProcs: (await egressCgroup)! });
    }
    const config = machineSpec({
      id: spec.id,
      hostname: spec.hostname,
      rootfs: p.rootfs,
      guestRuntimeDir: opts.guestRuntimeDir,
      runDir: p.run,
      listenFd: passFd,
      etc: { hosts: join(p.etc, "hosts"), hostname: join(p.etc, "hostname"), resolv: join(p.etc, "resolv.conf") },
      mounts: ids.idmapped ? spec.mounts.map((m, i) => ({ ...m, hostPath: binds[i].target })) : spec.mounts,
      vcpus: spec.vcpus,
      memoryMb: spec.memoryMb,
      limitSwap,
      pidsLimit: PIDS_LIMIT,
      nofile,
      cgroupsPath: `/kiln/${spec.id}`,
      runtime: opts.runtime,
      netnsPath: netnsFirst ? p.netns : undefined,
      ids: identities.specIds(ids, p.dir),
    });
    const [, , , rootPending] = await Promise.all([writeFile(join(p.dir, "config.json"), JSON.stringify(config)), rm(p.socket, { force: true }), rm(p.pidFile, { force: true }), mountRoot(spec, p, viaHelper)]);
    const tDisk = performance.now();
    // runsc: the agent (machine root) makes its socket in the bound run dir, which is locked again once it has.
    if (!passFd) await chown(p.run, ids.hostBase, ids.hostBase);
    // A restored agent has no socket and listens again once this appears (it polls; nothing can reach it yet).
    if (restoreImage) await writeFile(join(p.run, RELISTEN_FILE), "");

    /** The runtime's command line; behind the mount helper when the machine has its own ids or namespace. */
    const runtimeCommand = async () => {
      const run = cli.runCommand({ id: spec.id, bundleDir: p.dir, pidFile: p.pidFile, internet: spec.internet, passListener: passFd, restoreFrom: restoreImage });
      if (!viaHelper) return run;
      const root = rootPending ? p.rootfs : undefined;
      return identities.command(ids, { dir: p.dir, layers: spec.layers, disk: p.layer.mountPoint, rootfs: root, binds, nofile: { soft: machineNofileSoft(nofile), hard: nofile } }, run);
    };

    let pid: number | undefined;
    const listener = passFd ? await hostListener(p.socket) : undefined;
    // Poll for the agent from the moment the runtime starts: `run --detach` returns after the first process is exec'd.
    // With a passed-in socket, polling starts once the host has let go of it (else the host would accept).
    let agentReady = passFd ? undefined : waitForAgent(p, spec.id, () => pid);
    agentReady?.catch(() => undefined);
    try {
      const [command, args] = await runtimeCommand();
      // Started by the host command helper (host-commands.ts), with the listener passed to it as fd 3.
      const exit = await runHost(command, args, { log: p.log, listener: listener?.server }).catch((err: unknown) => {
        throw new Error(`${opts.runtime} could not be started: ${(err as Error).message}`);
      });
      if (exit.code !== 0) throw new Error(`${opts.runtime} run of ${spec.id} exited ${exit.code ?? exit.signal}`);
      pid = Number(await readFile(p.pidFile, "utf8"));
    } catch (err) {
      throw new Error(`${(err as Error).message}: ${await tail(p.log)}`);
    } finally {
      await listener?.close();
    }
    agentReady ??= waitForAgent(p, spec.id, () => pid);
    const tRun = performance.now();
    // The agent and the network come up in parallel; a machine is handed out only once both are there. A kernel
    // restored from another machine's image still carries that machine's hostname: renamed meanwhile, by a `runsc
    // exec` (40–480 ms, measured) that the caller awaits only before handing the machine out, so its own set-up
    // calls to the agent (which read no hostname) overlap it. Its own image (a resume) has its own name already.
    let tAgent = 0;
    let tNet = 0;
    let tName = 0;
    const renamed = restoreImage && rename ? cli.setHostname(spec.id, spec.hostname).then(() => void (tName = performance.now())) : undefined;
    renamed?.catch(() => undefined);
    await Promise.all([
      agentReady.then(() => (tAgent = performance.now())),
      // runc with internet: slirp4netns's start sets the loopback's quickack too (one host command for both).
      spec.internet && !netnsFirst
        ? egressCgroup!.then((cgroupProcs) => startSlirp({ target: { pid: pid! }, hostAccess: opts.hostAccess, pidFile: p.slirpPid, logFile: p.slirpLog, cgroupProcs, quickAck: opts.runtime === "runc" })).then(() => (tNet = performance.now()))
        : undefined,
      // A slow loopback costs latency, not correctness: the machine boots either way.
      opts.runtime === "runc" && !spec.internet ? quickAckLoopback(pid!).catch((err: unknown) => opts.log.warn({ err, machine_id: spec.id }, "the machine's loopback keeps delayed ACKs")) : undefined,
    ]);
    // Machine root could otherwise swap its socket for a symlink the host would follow (to another machine's agent).
    if (!passFd) await Promise.all([chown(p.run, 0, 0), chmod(p.run, 0o755), rm(join(p.run, RELISTEN_FILE), { force: true })]);
    const ms = (a: number, b: number) => Math.round((b - a) * 10) / 10;
    // From the boot's start: disk and bundle ready, the runtime's `run` returned, the agent answering, the network up.
    const tBooted = performance.now();
    // A renamed machine's line waits for its rename (renamed_ms, from the runtime's return like agent_ms).
    const log = (named?: number) => opts.log.debug({ machine_id: spec.id, disk_ms: ms(t0, tDisk), run_ms: ms(t0, tRun), agent_ms: ms(tRun, tAgent), network_ms: tNet ? ms(tRun, tNet) : undefined, booted_ms: ms(t0, tBooted), renamed_ms: named ? ms(tRun, named) : undefined }, "machine booted");
    if (!renamed) log();
    else void renamed.then(() => log(tName), () => undefined);
    return { id: spec.id, state: "running", agentSocket: p.socket, pid, renamed };
  }

  async function create(spec: MachineSpec): Promise<LiveMachine> {
    if ((spec.restore || spec.fromSnapshot?.memory) && opts.runtime !== "runsc") throw new Error("only runsc machines can be restored from a checkpoint");
    if (spec.restore && spec.restore.internet !== spec.internet) throw new Error("a checkpoint restores only into a machine with the same network setting");
    // The saved writable layer lies over the template's as their highest layer: the restored processes find the
    // files they had open, and the machine's own writes still go to its own upper dir. A later start keeps it.
    if (spec.restore) spec = { ...spec, layers: [...spec.layers, spec.restore.upperDir] };
    const t0 = performance.now();
    const p = paths(spec.id);
    if (existsSync(p.dir)) throw new Error(`machine ${spec.id} already exists on this host`);
    await Promise.all([mkdir(machinesDir, { recursive: true }), mkdir(stateRoot, { recursive: true })]);
    ensureTraversable(opts.dataDir);
    ensureTraversable(machinesDir);
    // Only root and machine root (the machines' group) may enter: its root fs is mounted here (umask 077: set by hand).
    await mkdir(p.dir);
    await chmod(p.dir, 0o710);
    if (!passFd) await mkdir(p.run);
    const [, , identity] = await Promise.all([writeEtc(spec, p), writeFile(p.spec, JSON.stringify(spec)), identities.assign(p.dir, spec.layers)]);
    // The group is this machine's root: no other machine's root may enter.
    await chown(p.dir, 0, identity.hostBase);
    // From a snapshot: the machine's disk is a copy of the snapshot's, mounted as it is (no spare, no mkfs). A memory
    // snapshot's is usually copied and mounted already (snapshot-spares.ts); another copy is made once this one boots.
    const spareOf = spec.fromSnapshot?.memory ? snapshotOf(spec.fromSnapshot.disk) : undefined;
    let spare = false;
    if (spec.fromSnapshot) {
      const { pool } = await storage();
      await mkdir(dirname(p.layer.image), { recursive: true });
      spare = spareOf !== undefined && (await snapshotSpares.take(spareOf, p.layer));
      if (!spare) await pool.clone(spec.fromSnapshot.disk, p.layer.image);
    }
    opts.log.debug({ machine_id: spec.id, prepare_ms: Math.round((performance.now() - t0) * 10) / 10, disk_ready: spareOf ? spare : undefined }, "machine prepared");
    try {
      return await boot(spec, spec.restore?.imageDir ?? spec.fromSnapshot?.memory ?? undefined, true);
    } finally {
      if (spareOf) snapshotSpares.prepare(spareOf, spec.fromSnapshot!.disk);
    }
  }

  /**
   * runc: a running machine takes a copy of a snapshot's disk as its own, without a boot. Its own disk leaves the host
   * at once — its root overlay and disk mounts detached, its image unlinked — and the copy is mounted in its place;
   * then the mount helper mounts the overlay root again over the copy and pivots the machine onto it (tini and the
   * agent keep running, their root and cwd moved). The old root goes once nothing in the machine holds it: the first
   * processes' stdout and stderr (runtime.log on the old disk) keep that disk's filesystem and loop device until
   * the machine ends (its image is already unlinked, so nothing else of it is left then).
   */
  async function takeSnapshotDisk(id: string, snapshotDisk: string): Promise<void> {
    const t0 = performance.now();
    const p = paths(id);
    const [spec, ids, pidText] = await Promise.all([readSpec(id), identities.read(p.dir), readFile(p.pidFile, "utf8")]);
    const pid = Number(pidText);
    if (!identities.usesHelper(ids)) throw new Error(`machine ${id} does not boot through the mount helper: its root cannot be swapped`);
    if (!Number.isSafeInteger(pid) || pid <= 1 || !pidAlive(pid)) throw new Error(`machine ${id} has no first process`);
    if (!existsSync(snapshotDisk)) throw new Error(`snapshot disk ${snapshotDisk} is missing`);
    const { pool } = await storage();
    // All of it in one run of the helper (each process started costs the most on a busy host): it reflinks the
    // snapshot's image itself where the pool can; a pool of plain copies makes the copy first.
    const reflink = pool.copies === "reflink";
    if (!reflink) await pool.clone(snapshotDisk, `${p.layer.image}.taking`);
    await identities.swapRoot(ids, { dir: p.dir, layers: spec.layers, disk: p.layer.mountPoint, rootfs: p.rootfs, image: p.layer.image, cloneFrom: reflink ? snapshotDisk : undefined }, pid);
    // The copy's runtime.log is its parent's; this machine's first processes still write to the old disk's.
    await writeFile(p.log, "");
    opts.log.debug({ machine_id: id, taken_ms: Math.round((performance.now() - t0) * 10) / 10 }, "snapshot disk taken by a running machine");
  }

  /**
   * runsc cannot save a sandbox that holds a socket bound to a host path, so the agent lets go of its socket first
   * (on SIGUSR2). The sandbox stops once saved; its upper dir is copied out as it was at that moment.
   */
  async function checkpoint(id: string, destDir: string): Promise<MachineCheckpoint> {
    const p = paths(id);
    const spec = JSON.parse(await readFile(p.spec, "utf8")) as MachineSpec;
    const saved: MachineCheckpoint = { imageDir: join(destDir, "image"), upperDir: join(destDir, "upper"), internet: spec.internet, guestRuntime: opts.guestRuntimeDir };
    try {
      await saveProcesses(id, p, saved.imageDir);
      await mkdir(saved.upperDir);
      await exec("cp", ["-a", "--preserve=all", `${p.layer.upper}/.`, saved.upperDir], { maxBuffer: 1024 * 1024 });
    } catch (err) {
      await rm(destDir, { recursive: true, force: true });
      throw new Error(`checkpointing ${id} failed: ${((err as { stderr?: string }).stderr || (err as Error).message).trim()}`);
    }
    return saved;
  }

  /**
   * runsc: the agent lets go of its socket, then the sandbox's processes and memory are saved into `imageDir`; the
   * sandbox stops once saved. (`runsc checkpoint --leave-running` would keep it going, but the agent's host socket
   * comes back broken from it: EBADF on this runsc. A snapshot restores the machine from its own image instead.)
   */
  async function saveProcesses(id: string, p: Paths, imageDir: string): Promise<void> {
    await cli.kill(id, "USR2");
    // The host side of a host-uds socket may still take connections for a moment: the agent no longer answering
    // is the sign, and runsc refusing a socket still bound is retried until the bound.
    const deadline = performance.now() + LET_GO_WAIT_MS;
    while (await answersHealth(p.socket, 200)) {
      if (performance.now() > deadline) throw new Error(`the guest agent of ${id} did not let go of its socket within ${LET_GO_WAIT_MS} ms`);
      await sleep(10);
    }
    await mkdir(imageDir, { recursive: true });
    const letGo = performance.now();
    for (;;) {
      try {
        await cli.checkpoint(id, imageDir);
        opts.log.debug({ machine_id: id, let_go_ms: Math.round(letGo - (deadline - LET_GO_WAIT_MS)), checkpoint_ms: Math.round(performance.now() - letGo) }, "machine's processes saved");
        return;
      } catch (err) {
        if (!/bound host socket/i.test((err as Error).message) || performance.now() > deadline) throw err;
        await sleep(50);
      }
    }
  }

  async function releaseNetwork(id: string, p: Paths) {
    await stopSlirp(p.slirpPid);
    await Promise.all([removeNetns(p.netns), egress.release(id, p.egress)]);
  }

  /**
   * A dead slirp4netns started again: into the same network namespace, in the same egress cgroup with the same
   * rules. runc: a fresh tap device, configured; runsc: the persistent one gVisor still holds, attached to only.
   */
  async function restartSlirp(spec: MachineSpec, p: Paths, firstPid: number): Promise<void> {
    await stopSlirp(p.slirpPid);
    const cgroupProcs = await egress.prepare(spec.id, opts.hostAccess, spec.network, p.egress);
    const common = { hostAccess: opts.hostAccess, pidFile: p.slirpPid, logFile: p.slirpLog, cgroupProcs };
    if (opts.runtime === "runsc") {
      if (!isMounted(p.netns)) throw new Error("its network namespace is gone");
      // Machines booted before the tap device was made persistent lost it with slirp4netns: gVisor cannot take a new one.
      await exec("nsenter", [`--net=${p.netns}`, "ip", "link", "show", "tap0"]).catch(() => {
        throw new Error("its network device went with it");
      });
      await startSlirp({ ...common, target: { netnsPath: p.netns }, configure: false });
    } else {
      await startSlirp({ ...common, target: { pid: firstPid } });
    }
  }

  async function heal(id: string): Promise<MachineHealth> {
    const p = paths(id);
    const repaired: string[] = [];
    const [runtimeLog, slirpLog] = await Promise.all([trimLog(p.log).catch(() => false), trimLog(p.slirpLog).catch(() => false)]);
    if (runtimeLog) repaired.push("runtime.log trimmed to its cap");
    if (slirpLog) repaired.push("slirp.log trimmed to its cap");
    const text = await readFile(p.spec, "utf8").catch(() => "");
    if (!text) return { ok: true, repaired };
    const spec = JSON.parse(text) as MachineSpec;
    // A machine whose own processes are gone is the reaper's (it tells why: out of memory, stopped unexpectedly).
    const first = Number(await readFile(p.pidFile, "utf8").catch(() => ""));
    if (!first || !pidAlive(first) || isZombie(first)) return { ok: true, repaired };
    if (spec.internet && !(await slirpAlive(p.slirpPid))) {
      try {
        await restartSlirp(spec, p, first);
      } catch (err) {
        return { ok: false, reason: `its network helper (slirp4netns) died and could not be started again: ${(err as Error).message}` };
      }
      repaired.push("network helper (slirp4netns) restarted");
    }
    return { ok: true, repaired };
  }

  /** The kernel's count of OOM kills in the machine's memory cgroup (v1 memory.oom_control, v2 memory.events). */
  async function oomKills(id: string): Promise<number> {
    const file = cgroups.version === "v2" ? `/sys/fs/cgroup/kiln/${id}/memory.events` : `/sys/fs/cgroup/memory/kiln/${id}/memory.oom_control`;
    const text = await readFile(file, "utf8").catch(() => "");
    return Number(/^oom_kill (\d+)/m.exec(text)?.[1] ?? 0);
  }

  async function destroy(id: string, opts: { leftover?: boolean } = {}): Promise<void> {
    const p = paths(id);
    await cli.remove(id);
    await Promise.all([releaseNetwork(id, p), removeCgroups(cgroups, `kiln/${id}`), settleRemovals(id)]);
    await unmountRoot(p);
    // The range goes back while the dir still names it (see id-ranges.ts), and the dir only once nothing is mounted
    // under it: rm -r through a live overlay would write whiteouts, not free space.
    await identities.release(p.dir, { ifIdle: opts.leftover });
    await Promise.all([rm(p.dir, { recursive: true, force: true }), rm(p.layer.image, { force: true }), rm(`${p.layer.image}.taking`, { force: true })]);
  }

  /**
   * The first half of a destroy, on the request's path: the marker, then every process of the machine killed through
   * its cgroup (no runtime process to start). A host where that cannot be done has the runtime kill it instead.
   */
  async function silence(id: string): Promise<void> {
    const p = paths(id);
    if (!existsSync(p.dir)) return;
    writeFileSync(join(p.dir, GOING_MARKER), ""); // microseconds: not queued behind the thread pool's slower work
    if (!(await killCgroup(cgroups, `kiln/${id}`))) await cli.remove(id);
  }

  /**
   * runc: new caps written on the machine's cgroup (as its spec would have set them at boot) and into its saved spec,
   * so a restart or a resume from disk boots it with them.
   */
  async function resize(id: string, limits: { vcpus: number; memoryMb: number }): Promise<void> {
    const spec = await readSpec(id);
    if (spec.vcpus === limits.vcpus && spec.memoryMb === limits.memoryMb) return;
    await setMachineLimits(cgroups, `kiln/${id}`, { cpuQuotaUs: Math.round(limits.vcpus * 100_000), memoryBytes: limits.memoryMb * 1024 * 1024, limitSwap });
    await writeFile(paths(id).spec, JSON.stringify({ ...spec, vcpus: limits.vcpus, memoryMb: limits.memoryMb }));
  }

  /** Stops a machine's processes and takes down its network, cgroups and mounts; its bundle and disk image stay. */
  async function stop(id: string): Promise<void> {
    const p = paths(id);
    await cli.remove(id);
    await Promise.all([releaseNetwork(id, p), removeCgroups(cgroups, `kiln/${id}`)]);
    await unmountRoot(p);
  }

  async function readSpec(id: string): Promise<MachineSpec> {
    const text = await readFile(paths(id).spec, "utf8").catch(() => {
      throw new Error(`machine ${id} does not exist on this host`);
    });
    return JSON.parse(text) as MachineSpec;
  }

  /** A restart boots afresh on the same layers and disk; a checkpoint or a snapshot's memory is for the first boot only. */
  const fresh = (spec: MachineSpec): MachineSpec => ({ ...spec, restore: undefined, fromSnapshot: undefined });

  const memoryUnsupported = () =>
    opts.runtime === "runsc"
      ? undefined
      : "saving a machine's memory needs the gVisor runtime (KILN_OCI_RUNTIME=runsc): runc would need CRIU, and CRIU 3.17 (Debian 12) cannot checkpoint on this kernel";

  async function hibernate(id: string, mode: HibernateMode = "freeze"): Promise<void> {
    if (mode === "freeze") return cli.pause(id);
    const p = paths(id);
    if (mode === "memory") {
      const why = memoryUnsupported();
      if (why) throw new Error(why);
      await rm(p.hibernation, { recursive: true, force: true });
      // A frozen machine is thawed first: its agent must let go of its socket before the save.
      if ((await cli.state(id))?.status === "paused") await cli.resume(id);
      await saveProcesses(id, p, p.hibernation).catch(async (err: unknown) => {
        await rm(p.hibernation, { recursive: true, force: true });
        throw err;
      });
    }
    await stop(id);
  }

  async function resume(id: string, mode: HibernateMode = "freeze"): Promise<LiveMachine> {
    if (mode === "freeze") {
      await cli.resume(id);
      const st = await cli.state(id);
      if (!st || st.status !== "running") throw new Error(`machine ${id} is ${st?.status ?? "gone"} after resume`);
      return { id, state: "running", agentSocket: paths(id).socket, pid: st.pid };
    }
    const p = paths(id);
    const spec = await readSpec(id);
    // A start after a crash may find the old container still registered (stopped): clear it first.
    await cli.remove(id);
    await releaseNetwork(id, p);
    if (mode === "disk") return boot(fresh(spec));
    if (!existsSync(p.hibernation)) throw new Error(`machine ${id} has no saved memory to resume from`);
    const live = await boot(fresh(spec), p.hibernation);
    // The saved image is consumed: a later hibernate saves a new one.
    await rm(p.hibernation, { recursive: true, force: true });
    return live;
  }

  /**
   * Saves the machine's disk (and with memory its processes) as a snapshot; the machine goes on as it was. A machine
   * whose disk is not mounted (hibernated to disk) has nothing in flight: its image is copied as it is.
   */
  /**
   * How a snapshot freezes the machine's processes. runc: its cgroup's freezer, written directly (what `runc pause`
   * does, without the two `runc` processes a pause and a resume cost: the larger part of a snapshot on a busy host).
   * runsc pauses inside its sandbox, so it keeps the runtime's own pause.
   */
  function freezeHooks(id: string, stopped: boolean): FreezeHooks {
    const freezer = opts.runtime === "runc" ? cgroupFreezer(cgroups, `${KILN_CGROUP}/${id}`) : undefined;
    if (!freezer) return { paused: async () => stopped || (await cli.state(id))?.status === "paused", pause: () => cli.pause(id), resume: () => cli.resume(id) };
    return { paused: async () => stopped || (await freezer.frozen()), pause: () => freezer.freeze(), resume: () => freezer.thaw() };
  }

  async function snapshot(id: string, snapshotId: string, o: { memory: boolean }): Promise<SavedSnapshot> {
    const p = paths(id);
    const { pool } = await storage();
    const dir = snapshotDir(snapshotId);
    const disk = join(dir, "disk.img");
    const memory = o.memory ? join(dir, "memory") : null;
    await mkdir(dir, { recursive: true });
    try {
      const mounted = isMounted(p.layer.mountPoint);
      const t0 = performance.now();
      // `stopped`: no process runs (a saved sandbox), so only the filesystem is frozen (fsfreeze flushes it).
      const copyDisk = (stopped = false) =>
        mounted
          ? copyLiveDisk({
              machineDir: p.dir,
              mountPoint: p.layer.mountPoint,
              image: p.layer.image,
              dest: disk,
              pool,
              hooks: freezeHooks(id, stopped),
            })
          : pool.clone(p.layer.image, disk).then(() => ({}));
      if (memory) {
        const why = memoryUnsupported();
        if (why) throw new Error(why);
        if ((await cli.state(id))?.status !== "running") throw new Error(`machine ${id} is not running: only a running machine's memory can be saved`);
        // The sandbox stops once saved, so the disk copied next is of the same instant; then the machine continues
        // from the image just saved (its processes go on; connections to its agent are cut, as by any restore).
        await saveProcesses(id, p, memory);
        const saved = performance.now();
        // The saved sandbox is taken down while its disk is copied: nothing of it writes any more, and a runsc delete
        // on a busy host takes as long as the rest of the save. Its pages, written past the page cache, are read back
        // into it meanwhile, so the restores that follow (this machine's, and its children's) do not wait on the disk.
        const takeDown = (async () => {
          await cli.remove(id);
          await releaseNetwork(id, p);
        })();
        const warm = readAhead(memory);
        /** The snapshot's files are complete once the disk is copied; the machine continues from them afterwards. */
        const restore = async (phases: Record<string, number>, copied: number) => {
          await takeDown;
          await warm;
          const restoring = performance.now();
          await boot(fresh(await readSpec(id)), memory);
          const round = (a: number, b: number) => Math.round((b - a) * 10) / 10;
          opts.log.debug({ machine_id: id, snapshot_id: snapshotId, save_ms: round(t0, saved), copy_ms: round(saved, copied), copy: phases, restore_wait_ms: round(copied, restoring), restore_ms: round(restoring, performance.now()) }, "memory snapshot taken");
        };
        let phases: Record<string, number>;
        try {
          phases = await copyDisk(true);
        } catch (err) {
          // No snapshot, but the machine goes on as it was.
          await restore({}, performance.now());
          throw err;
        }
        // The next machine restored from this snapshot finds its disk copied and mounted (made while the saved sandbox
        // is taken down, which the restore here waits for anyway).
        snapshotSpares.prepare(snapshotId, disk);
        const continued = restore(phases, performance.now());
        continued.catch(() => undefined); // the caller is told through `continued`
        const sizes = await Promise.all([allocatedBytes(disk), dirBytes(memory)]);
        return { disk, memory, sizeBytes: sizes[0] + sizes[1], runtime: opts.runtime, guestRuntime: opts.guestRuntimeDir, continued };
      } else {
        const phases = await copyDisk();
        opts.log.debug({ machine_id: id, snapshot_id: snapshotId, ...phases, total_ms: Math.round((performance.now() - t0) * 10) / 10 }, "disk snapshot taken");
      }
      const sizes = await Promise.all([allocatedBytes(disk), memory ? dirBytes(memory) : 0]);
      return { disk, memory, sizeBytes: sizes[0] + sizes[1], runtime: opts.runtime, guestRuntime: opts.guestRuntimeDir };
    } catch (err) {
      await rm(dir, { recursive: true, force: true });
      throw err;
    }
  }

  async function readiness(): Promise<DriverReadiness> {
    if (readinessCache && Date.now() - readinessCache.at < 10_000) return readinessCache.value;
    const problems: string[] = [];
    let version = "";
    try {
      version = await cli.version();
    } catch {
      problems.push(`${opts.runtime} is not installed`);
    }
    const released = /(\d{8})/.exec(version)?.[1];
    if (opts.runtime === "runsc" && released && released < RUNSC_MIN_RELEASE) {
      problems.push(`runsc ${released} is too old: Kiln needs ${RUNSC_MIN_RELEASE} or newer (Debian bookworm-backports has it)`);
    }
    if (!(await guestRuntimeComplete(opts.guestRuntimeDir))) problems.push(`the guest runtime at ${opts.guestRuntimeDir} is incomplete`);
    const slirp = existsSync("/usr/bin/slirp4netns");
    let egressProblem: string | undefined;
    await egress.ensure().catch((err: unknown) => (egressProblem = (err as Error).message));
    if (egressProblem) problems.push(`machines' egress cannot be filtered: ${egressProblem}`);
    const value: DriverReadiness = {
      driver: "oci",
      runtime: opts.runtime,
      ready: problems.length === 0,
      detail: problems.length ? problems.join("; ") : version,
      identity: await identities.readiness(),
      cgroup: cgroups,
      network: slirp
        ? `slirp4netns (user-mode NAT per machine${opts.runtime === "runsc" ? ", into gVisor's own network stack" : ""}); loopback only when internet is off; egress: ${egress.describe()}`
        : "loopback only: slirp4netns is not installed",
    };
    readinessCache = { at: Date.now(), value };
    return value;
  }

  return {
    name: "oci",
    readiness,
    create,

    stop,

    async start(id) {
      return resume(id, "disk");
    },

    hibernate,
    resume,
    ...(opts.runtime === "runc" ? { takeSnapshotDisk } : {}),
    // A step's processes are ended through the cgroup freezer: without one, each step boots its own build machine.
    ...(opts.runtime === "runc" && cgroups.enforced.includes("freezer") ? { copyLayer, renewLayer } : {}),
    memorySnapshotsUnsupported: memoryUnsupported,
    snapshot,

    async deleteSnapshot(snapshotId) {
      const dir = snapshotDir(snapshotId);
      // Removed first, so a copy being made of it meanwhile is not kept (snapshot-spares.ts checks once it is made).
      await rm(dir, { recursive: true, force: true });
      await snapshotSpares.drop(snapshotId);
    },

    async listSnapshots() {
      // Asked at start: a read of a snapshot's files a killed server left mounted goes too.
      await sweepSnapshotReads(opts.dataDir);
      await snapshotSpares.sweep();
      return readdir(join(opts.dataDir, "disks", "snapshots")).catch(() => []);
    },

    async snapshotLayer(snapshotId, destDir) {
      const image = join(snapshotDir(snapshotId), "disk.img");
      if (!existsSync(image)) throw new Error(`snapshot ${snapshotId} has no disk on this host`);
      await copySnapshotLayer({ dataDir: opts.dataDir, image, dest: destDir });
    },

    canRestoreSnapshot: (saved) => saved.memory === null || (opts.runtime === "runsc" && saved.guestRuntime === opts.guestRuntimeDir && existsSync(saved.memory)),

    async captureLayer(id, destDir) {
      const p = paths(id);
      await cli.remove(id);
      await Promise.all([releaseNetwork(id, p), removeCgroups(cgroups, `kiln/${id}`), settleRemovals(id)]);
      // Only the overlay root comes down first: the upper dir lives on the machine's own disk image, so it is copied
      // out (ownership already in the machines' range, whiteout devices and opaque xattrs kept) before the image goes.
      if (existsSync(p.rootfs) && isMounted(p.rootfs)) {
        await exec("umount", [p.rootfs]).catch(() => exec("umount", ["-l", p.rootfs]));
        if (isMounted(p.rootfs)) throw new Error(`${p.rootfs} is still mounted`);
      }
      await copyUpper(id, (await currentUpper(p)).upper, destDir);
      await unmountWritableLayer(p.layer);
      await identities.unmountLeftovers(p.dir);
      // What is left (bundle, the disk image, sockets) goes as in destroy; the runtime already has no container.
      await identities.release(p.dir);
      await Promise.all([rm(p.dir, { recursive: true, force: true }), rm(p.layer.image, { force: true })]);
    },

    checkpoint: opts.runtime === "runsc" ? checkpoint : undefined,
    canRestore: (saved) => opts.runtime === "runsc" && saved.guestRuntime === opts.guestRuntimeDir && existsSync(saved.imageDir) && existsSync(saved.upperDir),

    destroy,
    silence,
    resize: opts.runtime === "runc" ? resize : undefined,
    heal,

    async updateNetwork(id, network) {
      const p = paths(id);
      const spec = JSON.parse(await readFile(p.spec, "utf8")) as MachineSpec;
      spec.network = network;
      // Kept first, so a restart of its slirp4netns (and its next boot) takes the new lists too.
      await writeFile(p.spec, JSON.stringify(spec));
      if (spec.internet) await egress.update(id, opts.hostAccess, network, p.egress);
    },

    async usage(id) {
      const p = paths(id);
      // Not mounted, statfs would describe the host's filesystem: then there is no disk figure.
      const mounted = isMounted(p.layer.mountPoint);
      const u = await machineUsage(cgroups, id, p.layer.mountPoint);
      return mounted ? u : { ...u, diskUsedBytes: null, diskTotalBytes: null };
    },

    async deathCause(id) {
      return (await oomKills(id)) > 0 ? "out_of_memory" : undefined;
    },

    async listLive() {
      const live: LiveMachine[] = [];
      for (const c of await cli.list()) {
        if (c.status !== "running" && c.status !== "paused") continue;
        if (!SAFE_ID.test(c.id) || !pidAlive(c.pid) || isZombie(c.pid)) continue;
        // A snapshot cut short by a crash left it frozen: thawed, it is the running machine it was.
        const p = paths(c.id);
        if (existsSync(join(p.dir, GOING_MARKER))) continue;
        if (await thawInterrupted(p.dir, p.layer.mountPoint, () => cli.resume(c.id))) c.status = (await cli.state(c.id))?.status ?? c.status;
        live.push({ id: c.id, state: c.status === "paused" ? "paused" : "running", agentSocket: p.socket, pid: c.pid });
      }
      return live;
    },

    async listKnown() {
      const names = await readdir(machinesDir).catch(() => [] as string[]);
      return names.filter((n) => SAFE_ID.test(n));
    },

    async close() {
      // Machines (and their slirp4netns) outlive the control plane on purpose; only the spare disks are released, and
      // the disk pool when no machine's disk is attached from it.
      // A pool an earlier server mounted is released too, even when this one never needed a disk.
      if (!poolOpening && !isMounted(join(opts.dataDir, "disks"))) return;
      const { pool, disks } = await storage();
      await Promise.all([disks.close(), snapshotSpares.close()]);
      await pool.close();
    },
  };
}
