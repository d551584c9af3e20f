// The `oci` MachineDriver: each machine is an OCI bundle (overlayfs root over the template's read-only layers)
// run by runc — or gVisor's runsc — under a Kiln-owned state root, so `list` sees only Kiln's machines.
// Long on purpose: one machine's lifecycle against runc/runsc (create, hibernate, resume, heal, destroy) in one place;
// disks, egress, identity, network and spec already live in their own files beside it.

import { execFile, spawn } from "node:child_process";
import { connect, createServer } from "node:net";
import { get as httpGet } from "node:http";
import { existsSync, openSync, closeSync, statSync, chmodSync, readFileSync } from "node:fs";
import { chmod, chown, link, mkdir, readFile, rm, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { promisify } from "node:util";
import { DEFAULT_DISK_MB } from "../driver.ts";
import type { DriverReadiness, LiveMachine, MachineCheckpoint, MachineDriver, MachineHealth, MachineSpec } from "../driver.ts";
import type { Logger } from "../../log.ts";
import { guestRuntimeComplete } from "../guest-runtime.ts";
import { CANONICAL_BASE } from "./idmap.ts";
import { createMachineIdentities, scratchDir } from "./identity.ts";
import { AGENT_SOCKET_NAME, machineNofileSoft, machineSpec } from "./spec.ts";
import { applyHostLimits, defaultHostLimits, detectCgroups, removeCgroups } from "./cgroups.ts";
import type { HostLimits } from "./cgroups.ts";
import { isMounted } from "./mounts.ts";
import { machineUsage } from "./usage.ts";
import { HOST_ALIAS, SLIRP_DNS, SLIRP_GATEWAY, makeNetns, removeNetns, slirpAlive, startSlirp, stopSlirp } from "./network.ts";
import { trimLog } from "./health.ts";
import { createDiskStock, mountWritableLayer, unmountWritableLayer, writableLayer } from "./disk.ts";
import { createEgress } from "./egress.ts";
import { createRuntimeCli, RUNSC_MIN_RELEASE } from "./runtime-cli.ts";
import { pidAlive } from "../pid-alive.ts";

export { HOST_ID_BASE, ID_RANGE } from "./idmap.ts";
export { containerName } from "./runtime-cli.ts";

const exec = promisify(execFile);

const AGENT_WAIT_MS = 15_000;
/** runsc: how long the agent may take to let go of its socket before a checkpoint (see agent/main.ts). */
const LET_GO_WAIT_MS = 5_000;
/** The file whose appearance in the bound run dir tells a restored agent to listen again (agent/main.ts). */
const RELISTEN_FILE = "relisten";
const PIDS_LIMIT = 4096;
/** Disks of the default size kept formatted and mounted, so a create waits for neither mkfs nor mount. */
const SPARE_DISKS = 3;
/** Machine ids become path components and runtime ids: nothing but these characters. */
const SAFE_ID = /^[A-Za-z0-9][A-Za-z0-9_-]{0,100}$/;
/** One per host: every Kiln server on it takes machines' uid ranges from the same pool. */
const DEFAULT_ID_RANGES_DIR = "/var/lib/kiln/id-ranges";

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
}

type Paths = ReturnType<typeof machinePaths>;

function machinePaths(machinesDir: string, id: string, runtime: "runc" | "runsc") {
  if (!SAFE_ID.test(id)) throw new Error(`invalid machine id ${JSON.stringify(id)}`);
  const dir = join(machinesDir, id);
  const layer = writableLayer(dir);
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
  };
}

/** The host's open-file hard limit: machine root cannot be given more than the process that starts it has. */
function hostNofile(): number {
  const m = /^Max open files\s+\S+\s+(\S+)/m.exec(readFileSync("/proc/self/limits", "utf8"));
  const hard = m && m[1] !== "unlimited" ? Number(m[1]) : 1_048_576;
  return Math.min(hard, 1_048_576);
}

async function tail(file: string, chars = 800): Promise<string> {
  const text = await readFile(file, "utf8").catch(() => "");
  return text.trim().slice(-chars);
}

/**
 * A listening unix socket made on the host for the agent to inherit. The path the control plane connects to is a
 * hard link made before the host closes its copy (closing unlinks the name it was bound to, not the link).
 */
async function hostListener(path: string): Promise<{ fd: number; close(): Promise<void> }> {
  const bound = `${path}.bind`;
  await rm(bound, { force: true });
  await rm(path, { force: true });
  const server = createServer();
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen({ path: bound, backlog: 511 }, () => resolve());
  });
  await link(bound, path);
  const fd = (server as unknown as { _handle: { fd: number } })._handle.fd;
  return { fd, close: () => new Promise<void>((resolve) => server.close(() => resolve())) };
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
  const paths = (id: string) => machinePaths(machinesDir, id, opts.runtime);
  const cli = createRuntimeCli({ runtime: opts.runtime, stateRoot, runscPlatform: opts.runscPlatform });
  const passFd = opts.runtime === "runc";
  // Disks are stored in the canonical range like every file at rest; a machine on its own range sees them idmapped.
  const disks = createDiskStock({ dir: join(opts.dataDir, "disk-stock"), sizeMb: DEFAULT_DISK_MB, count: SPARE_DISKS, owner: CANONICAL_BASE, log: opts.log });
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

  /** Writes the bundle's config.json afresh (the guest runtime may have been rebuilt since) and runs it. */
  async function boot(spec: MachineSpec): Promise<LiveMachine> {
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
    // runsc: the agent (machine root) makes its socket in the bound run dir, which is locked again once it has.
    if (!passFd) await chown(p.run, ids.hostBase, ids.hostBase);
    // A restored agent has no socket and listens again once this appears (it polls; nothing can reach it yet).
    if (spec.restore) await writeFile(join(p.run, RELISTEN_FILE), "");

    /** The runtime's command line; behind the mount helper when the machine has its own ids or namespace. */
    const runtimeCommand = async () => {
      const run = cli.runCommand({ id: spec.id, bundleDir: p.dir, pidFile: p.pidFile, internet: spec.internet, passListener: passFd, restoreFrom: spec.restore?.imageDir });
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
    const log = openSync(p.log, "a");
    try {
      const [command, args] = await runtimeCommand();
      await new Promise<void>((resolve, reject) => {
        const child = spawn(command, args, { stdio: listener ? ["ignore", log, log, listener.fd] : ["ignore", log, log] });
        child.once("error", (err) => reject(new Error(`${opts.runtime} could not be started: ${err.message}`)));
        child.once("exit", (code, signal) => (code === 0 ? resolve() : reject(new Error(`${opts.runtime} run of ${spec.id} exited ${code ?? signal}`))));
      });
      pid = Number(await readFile(p.pidFile, "utf8"));
    } catch (err) {
      throw new Error(`${(err as Error).message}: ${await tail(p.log)}`);
    } finally {
      closeSync(log);
      await listener?.close();
    }
    agentReady ??= waitForAgent(p, spec.id, () => pid);
    const tRun = performance.now();
    // The agent and the network come up in parallel; a machine is handed out only once both are there.
    await Promise.all([
      agentReady,
      spec.internet && !netnsFirst ? egressCgroup!.then((cgroupProcs) => startSlirp({ target: { pid: pid! }, hostAccess: opts.hostAccess, pidFile: p.slirpPid, logFile: p.slirpLog, cgroupProcs })) : undefined,
    ]);
    // The restored kernel still carries the build machine's hostname.
    if (spec.restore) await cli.setHostname(spec.id, spec.hostname);
    // Machine root could otherwise swap its socket for a symlink the host would follow (to another machine's agent).
    if (!passFd) await Promise.all([chown(p.run, 0, 0), chmod(p.run, 0o755), rm(join(p.run, RELISTEN_FILE), { force: true })]);
    const ms = (a: number, b: number) => Math.round((b - a) * 10) / 10;
    opts.log.debug({ machine_id: spec.id, run_ms: ms(t0, tRun), agent_ms: ms(tRun, performance.now()) }, "machine booted");
    return { id: spec.id, state: "running", agentSocket: p.socket, pid };
  }

  async function create(spec: MachineSpec): Promise<LiveMachine> {
    if (spec.restore && opts.runtime !== "runsc") throw new Error("only runsc machines can be restored from a checkpoint");
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
    opts.log.debug({ machine_id: spec.id, prepare_ms: Math.round((performance.now() - t0) * 10) / 10 }, "machine prepared");
    return boot(spec);
  }

  /**
   * runsc cannot save a sandbox that holds a socket bound to a host path, so the agent lets go of its socket first
   * (on SIGUSR2). The sandbox stops once saved; its upper dir is copied out as it was at that moment.
   */
  async function checkpoint(id: string, destDir: string): Promise<MachineCheckpoint> {
    const p = paths(id);
    const spec = JSON.parse(await readFile(p.spec, "utf8")) as MachineSpec;
    const saved: MachineCheckpoint = { imageDir: join(destDir, "image"), upperDir: join(destDir, "upper"), internet: spec.internet, guestRuntime: opts.guestRuntimeDir };
    await cli.kill(id, "USR2");
    // The host side of a host-uds socket may still take connections for a moment: the agent no longer answering
    // is the sign, and runsc refusing a socket still bound is retried until the bound.
    const deadline = performance.now() + LET_GO_WAIT_MS;
    while (await answersHealth(p.socket, 200)) {
      if (performance.now() > deadline) throw new Error(`the guest agent of ${id} did not let go of its socket within ${LET_GO_WAIT_MS} ms`);
      await sleep(10);
    }
    await mkdir(saved.imageDir, { recursive: true });
    try {
      for (;;) {
        try {
          await cli.checkpoint(id, saved.imageDir);
          break;
        } catch (err) {
          if (!/bound host socket/i.test((err as Error).message) || performance.now() > deadline) throw err;
          await sleep(50);
        }
      }
      await mkdir(saved.upperDir);
      await exec("cp", ["-a", "--preserve=all", `${p.layer.upper}/.`, saved.upperDir], { maxBuffer: 1024 * 1024 });
    } catch (err) {
      await rm(destDir, { recursive: true, force: true });
      throw new Error(`checkpointing ${id} failed: ${((err as { stderr?: string }).stderr || (err as Error).message).trim()}`);
    }
    return saved;
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

  async function destroy(id: string): Promise<void> {
    const p = paths(id);
    await cli.remove(id);
    await Promise.all([releaseNetwork(id, p), removeCgroups(cgroups, `kiln/${id}`)]);
    await unmountRoot(p);
    // The range goes back while the dir still names it (see id-ranges.ts), and the dir only once nothing is mounted
    // under it: rm -r through a live overlay would write whiteouts, not free space.
    await identities.release(p.dir);
    await rm(p.dir, { recursive: true, force: true });
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

    async stop(id) {
      const p = paths(id);
      await cli.remove(id);
      await Promise.all([releaseNetwork(id, p), removeCgroups(cgroups, `kiln/${id}`)]);
      await unmountRoot(p);
    },

    async start(id) {
      const p = paths(id);
      const spec = JSON.parse(await readFile(p.spec, "utf8").catch(() => {
        throw new Error(`machine ${id} does not exist on this host`);
      })) as MachineSpec;
      // A start after a crash may find the old container still registered (stopped): clear it first.
      await cli.remove(id);
      await releaseNetwork(id, p);
      // A restart boots afresh on the same layers; the checkpoint is for the first boot only.
      return boot({ ...spec, restore: undefined });
    },

    async hibernate(id) {
      await cli.pause(id);
    },

    async resume(id) {
      await cli.resume(id);
      const st = await cli.state(id);
      if (!st || st.status !== "running") throw new Error(`machine ${id} is ${st?.status ?? "gone"} after resume`);
      return { id, state: "running", agentSocket: paths(id).socket, pid: st.pid };
    },

    async captureLayer(id, destDir) {
      const p = paths(id);
      await cli.remove(id);
      await Promise.all([releaseNetwork(id, p), removeCgroups(cgroups, `kiln/${id}`)]);
      // Only the overlay root comes down first: the upper dir lives on the machine's own disk image, so it is copied
      // out (ownership already in the machines' range, whiteout devices and opaque xattrs kept) before the image goes.
      if (existsSync(p.rootfs) && isMounted(p.rootfs)) {
        await exec("umount", [p.rootfs]).catch(() => exec("umount", ["-l", p.rootfs]));
        if (isMounted(p.rootfs)) throw new Error(`${p.rootfs} is still mounted`);
      }
      await mkdir(destDir, { recursive: true });
      try {
        await exec("cp", ["-a", "--preserve=all", `${p.layer.upper}/.`, destDir], { maxBuffer: 1024 * 1024 });
      } catch (err) {
        await rm(destDir, { recursive: true, force: true });
        throw new Error(`taking the layer of ${id} failed: ${((err as { stderr?: string }).stderr || (err as Error).message).trim()}`);
      }
      await unmountWritableLayer(p.layer);
      await identities.unmountLeftovers(p.dir);
      // What is left (bundle, the disk image, sockets) goes as in destroy; the runtime already has no container.
      await identities.release(p.dir);
      await rm(p.dir, { recursive: true, force: true });
    },

    checkpoint: opts.runtime === "runsc" ? checkpoint : undefined,
    canRestore: (saved) => opts.runtime === "runsc" && saved.guestRuntime === opts.guestRuntimeDir && existsSync(saved.imageDir) && existsSync(saved.upperDir),

    destroy,
    heal,

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
        live.push({ id: c.id, state: c.status === "paused" ? "paused" : "running", agentSocket: paths(c.id).socket, pid: c.pid });
      }
      return live;
    },

    async close() {
      // Machines (and their slirp4netns) outlive the control plane on purpose; only the spare disks are released.
      await disks.close();
    },
  };
}
