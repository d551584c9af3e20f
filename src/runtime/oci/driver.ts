// The `oci` MachineDriver: each machine is an OCI bundle (overlayfs root over the template's read-only layers)
// run by runc — or gVisor's runsc — under a Kiln-owned state root, so `list` sees only Kiln's machines.

import { execFile, spawn } from "node:child_process";
import { connect } from "node:net";
import { existsSync, openSync, closeSync, statSync, chmodSync, watch } from "node:fs";
import { chown, mkdir, readFile, rm, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { promisify } from "node:util";
import type { DriverReadiness, LiveMachine, MachineDriver, MachineSpec } from "../driver.ts";
import type { Logger } from "../../log.ts";
import { HOST_ID_BASE } from "./idmap.ts";
import { AGENT_SOCKET_NAME, machineSpec } from "./spec.ts";
import { detectCgroups } from "./cgroups.ts";
import { HOST_ALIAS, SLIRP_DNS, SLIRP_GATEWAY, startSlirp, stopSlirp } from "./network.ts";

const run = promisify(execFile);
const CONTAINER_PREFIX = "kiln-";
const AGENT_WAIT_MS = 15_000;
const PIDS_LIMIT = 4096;

export interface OciDriverOptions {
  dataDir: string;
  runtime: "runc" | "runsc";
  hostAccess: boolean;
  log: Logger;
  guestRuntimeDir: string;
}

export function createOciDriver(opts: OciDriverOptions): MachineDriver {
  const machinesDir = join(opts.dataDir, "machines");
  const stateRoot = join(opts.dataDir, "oci-state", opts.runtime);
  const cgroups = detectCgroups();
  let readinessCache: { at: number; value: DriverReadiness } | undefined;
  const paths = (id: string) => {
    const dir = join(machinesDir, id);
    return {
      dir,
      bundle: dir,
      rootfs: join(dir, "rootfs"),
      upper: join(dir, "upper"),
      work: join(dir, "work"),
      run: join(dir, "run"),
      etc: join(dir, "etc"),
      socket: join(dir, "run", AGENT_SOCKET_NAME),
      log: join(dir, "runtime.log"),
      pidFile: join(dir, "runtime.pid"),
      slirpPid: join(dir, "slirp.pid"),
      slirpLog: join(dir, "slirp.log"),
    };
  };

  function runtimeArgs(): string[] {
    const base = ["--root", stateRoot];
    if (opts.runtime === "runsc") base.push("--platform=ptrace", "--network=sandbox", "--host-uds=all", "--ignore-cgroups");
    return base;
  }

  async function runtime(args: string[], timeoutMs = 30_000): Promise<string> {
    try {
      const { stdout } = await run(opts.runtime, [...runtimeArgs(), ...args], { timeout: timeoutMs, maxBuffer: 16 * 1024 * 1024 });
      return stdout;
    } catch (err) {
      const e = err as { stderr?: string; message: string };
      throw new Error(`${opts.runtime} ${args[0]} failed: ${(e.stderr || e.message).trim().slice(-600)}`);
    }
  }

  /** Machine users (host uid 100000+) must be able to reach the bundle: give the data dir o+x if it lacks it. */
  function ensureTraversable(dir: string) {
    const st = statSync(dir);
    if ((st.mode & 0o001) === 0) chmodSync(dir, st.mode | 0o711);
  }

  async function mountRoot(spec: MachineSpec, p: ReturnType<typeof paths>) {
    await mkdir(p.rootfs, { recursive: true });
    await mkdir(p.upper, { recursive: true });
    await mkdir(p.work, { recursive: true });
    // The merged root takes its owner from the upper dir: machine root, not host root.
    await chown(p.upper, HOST_ID_BASE, HOST_ID_BASE);
    const lower = [...spec.layers].reverse().join(":"); // overlayfs lists the highest layer first
    await run("mount", ["-t", "overlay", "overlay", "-o", `lowerdir=${lower},upperdir=${p.upper},workdir=${p.work}`, p.rootfs]);
  }

  async function writeEtc(spec: MachineSpec, p: ReturnType<typeof paths>) {
    await mkdir(p.etc, { recursive: true });
    const hosts = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", `127.0.1.1\t${spec.hostname}`];
    if (opts.hostAccess && spec.internet) hosts.push(`${SLIRP_GATEWAY}\t${HOST_ALIAS}`);
    await writeFile(join(p.etc, "hosts"), hosts.join("\n") + "\n");
    await writeFile(join(p.etc, "hostname"), spec.hostname + "\n");
    await writeFile(join(p.etc, "resolv.conf"), spec.internet ? `nameserver ${SLIRP_DNS}\n` : "");
  }

  /** Resolves once the agent accepts connections; woken by inotify when the socket appears, not by polling. */
  function waitForAgent(p: ReturnType<typeof paths>, id: string): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      let done = false;
      const watcher = watch(p.run, () => void attempt());
      const retry = setInterval(() => void attempt(), 50);
      const timer = setTimeout(async () => {
        finish();
        const tail = await readFile(p.log, "utf8").catch(() => "");
        reject(new Error(`the guest agent of ${id} did not answer within ${AGENT_WAIT_MS} ms${tail ? `: ${tail.slice(-600)}` : ""}`));
      }, AGENT_WAIT_MS);
      function finish() {
        done = true;
        watcher.close();
        clearInterval(retry);
        clearTimeout(timer);
      }
      function attempt() {
        if (done || !existsSync(p.socket)) return;
        const s = connect(p.socket);
        s.once("connect", () => {
          s.destroy();
          if (done) return;
          finish();
          resolve();
        });
        s.once("error", () => s.destroy());
      }
    });
  }

  async function state(id: string): Promise<{ pid: number; status: string } | undefined> {
    try {
      const s = JSON.parse(await runtime(["state", CONTAINER_PREFIX + id], 10_000)) as { pid: number; status: string };
      return s;
    } catch {
      return undefined;
    }
  }

  async function boot(spec: MachineSpec): Promise<LiveMachine> {
    const t0 = performance.now();
    const p = paths(spec.id);
    await rm(p.socket, { force: true });
    // Watch for the agent's socket from before the machine starts, so its first moment is not missed.
    const agentReady = waitForAgent(p, spec.id);
    agentReady.catch(() => undefined);
    const log = openSync(p.log, "a");
    try {
      // `run --detach` returns once the container's first process is started; its stdio goes to the log.
      await new Promise<void>((resolve, reject) => {
        const child = spawn(opts.runtime, [...runtimeArgs(), "run", "--detach", "--pid-file", p.pidFile, "--bundle", p.bundle, CONTAINER_PREFIX + spec.id], { stdio: ["ignore", log, log] });
        child.once("error", reject);
        child.once("exit", (code) => (code === 0 ? resolve() : reject(new Error(`${opts.runtime} run exited ${code}`))));
      });
    } catch (err) {
      const tail = await readFile(p.log, "utf8").catch(() => "");
      throw new Error(`${(err as Error).message}: ${tail.slice(-800)}`);
    } finally {
      closeSync(log);
    }
    const tRun = performance.now();
    const pid = Number(await readFile(p.pidFile, "utf8"));
    await Promise.all([agentReady, spec.internet ? startSlirp({ pid, hostAccess: opts.hostAccess, pidFile: p.slirpPid, logFile: p.slirpLog }) : undefined]);
    const ms = (a: number, b: number) => Math.round((b - a) * 10) / 10;
    opts.log.debug({ machine_id: spec.id, run_ms: ms(t0, tRun), ready_ms: ms(tRun, performance.now()) }, "machine booted");
    return { id: spec.id, state: "running", agentSocket: p.socket, pid };
  }

  async function create(spec: MachineSpec): Promise<LiveMachine> {
    const t0 = performance.now();
    await mkdir(machinesDir, { recursive: true });
    await mkdir(stateRoot, { recursive: true });
    ensureTraversable(opts.dataDir);
    ensureTraversable(machinesDir);
    const p = paths(spec.id);
    await mkdir(p.dir, { recursive: true, mode: 0o711 });
    await mkdir(p.run, { recursive: true });
    await chown(p.run, HOST_ID_BASE, HOST_ID_BASE);
    await writeEtc(spec, p);
    await mountRoot(spec, p);
    const config = machineSpec({
      id: spec.id,
      hostname: spec.hostname,
      rootfs: p.rootfs,
      guestRuntimeDir: opts.guestRuntimeDir,
      runDir: p.run,
      etc: { hosts: join(p.etc, "hosts"), hostname: join(p.etc, "hostname"), resolv: join(p.etc, "resolv.conf") },
      mounts: spec.mounts,
      vcpus: spec.vcpus,
      memoryMb: spec.memoryMb,
      pidsLimit: PIDS_LIMIT,
      cgroupsPath: `/kiln/${spec.id}`,
      runtime: opts.runtime,
    });
    await writeFile(join(p.bundle, "config.json"), JSON.stringify(config));
    await writeFile(join(p.dir, "machine.json"), JSON.stringify(spec));
    opts.log.debug({ machine_id: spec.id, prepare_ms: Math.round((performance.now() - t0) * 10) / 10 }, "machine bundle prepared");
    return boot(spec);
  }

  async function destroy(id: string): Promise<void> {
    const p = paths(id);
    const name = CONTAINER_PREFIX + id;
    await runtime(["kill", name, "KILL"], 10_000).catch(() => undefined);
    await runtime(["delete", "--force", name], 20_000).catch(() => undefined);
    await stopSlirp(p.slirpPid);
    if (existsSync(p.rootfs)) {
      await run("umount", [p.rootfs]).catch(() => run("umount", ["-l", p.rootfs]).catch(() => undefined));
    }
    await rm(p.dir, { recursive: true, force: true });
  }

  return {
    name: "oci",

    async readiness(): Promise<DriverReadiness> {
      if (readinessCache && Date.now() - readinessCache.at < 10_000) return readinessCache.value;
      let ready = true;
      let detail = "";
      try {
        detail = (await run(opts.runtime, ["--version"])).stdout.split("\n")[0];
      } catch {
        ready = false;
        detail = `${opts.runtime} is not installed`;
      }
      const value: DriverReadiness = {
        driver: "oci",
        runtime: opts.runtime,
        ready,
        detail,
        cgroup: cgroups,
        network: existsSync("/usr/bin/slirp4netns") ? "slirp4netns (user-mode NAT per machine)" : "none: slirp4netns is not installed",
      };
      readinessCache = { at: Date.now(), value };
      return value;
    },

    create,

    async stop(id) {
      const name = CONTAINER_PREFIX + id;
      await runtime(["kill", name, "KILL"], 10_000).catch(() => undefined);
      await runtime(["delete", "--force", name], 20_000).catch(() => undefined);
      await stopSlirp(paths(id).slirpPid);
    },

    async start(id) {
      const spec = JSON.parse(await readFile(join(paths(id).dir, "machine.json"), "utf8")) as MachineSpec;
      return boot(spec);
    },

    async hibernate(id) {
      await runtime(["pause", CONTAINER_PREFIX + id]);
    },

    async resume(id) {
      await runtime(["resume", CONTAINER_PREFIX + id]);
      const st = await state(id);
      if (!st) throw new Error(`machine ${id} is gone`);
      return { id, state: "running", agentSocket: paths(id).socket, pid: st.pid };
    },

    destroy,

    async listLive() {
      if (!existsSync(stateRoot)) return [];
      const list = JSON.parse((await runtime(["list", "--format", "json"], 20_000)) || "null") as { id: string; pid: number; status: string }[] | null;
      return (list ?? [])
        .filter((c) => c.id.startsWith(CONTAINER_PREFIX) && (c.status === "running" || c.status === "paused"))
        .map((c) => {
          const id = c.id.slice(CONTAINER_PREFIX.length);
          return { id, state: c.status === "paused" ? ("paused" as const) : ("running" as const), agentSocket: paths(id).socket, pid: c.pid };
        });
    },

    async close() {
      // Machines outlive the control plane on purpose; nothing to release here.
    },
  };
}
