// Which host ids each machine runs on and who the kernel charges its per-user counters to: a range of its own from
// the host-wide pool where the host allows idmapped mounts, its user namespace owned by a host uid of its own (runc),
// and the mount helper's part of every boot. What the host enforces is reported as-is to GET /v1/ready.

import { existsSync, readFileSync, statSync } from "node:fs";
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { execHost } from "../host-commands.ts";
import type { Logger } from "../../log.ts";
import { CANONICAL_BASE, ID_POOL_LAST, ID_RANGE, SHARED_IDENTITY, rangeBase } from "./idmap.ts";
import type { MachineIdentity } from "./idmap.ts";
import { createIdRangePool } from "./id-ranges.ts";
import { bootCommand, prepareIdmountHelper, probeIdmappedMounts, swapCommand } from "./idmount.ts";
import type { BootPlan, Helper } from "./idmount.ts";

// Started by the host command helper, not by the server's own thread (host-commands.ts).
const exec = execHost;
const RECORD = "identity.json";

/**
 * Caps on the kernel's per-user counters a machine's user namespace takes from its maker (runc machines). Charged
 * to the machine's own host uid, each machine has this much of its own: no machine can use up the host's or
 * another machine's. (Linux's defaults for one user, but pending signals, fixed here rather than RAM-derived.)
 */
export const MACHINE_RLIMITS = { msgqueue: 819_200, sigpending: 16_384, memlock: 8 * 1024 * 1024 };
/** Inside a machine, one uid may hold this share of the machine's inotify/fanotify allowance: root keeps the rest. */
const PER_UID_SHARE = 0.75;
const COUNTERS = ["max_inotify_instances", "max_inotify_watches", "max_fanotify_groups", "max_fanotify_marks"] as const;

export interface IdentityReadiness {
  /** `per-machine`: every machine on its own host ids; `shared`: all machines on one range (and why). */
  uid_ranges: "per-machine" | "shared";
  idmapped_mounts: boolean;
  /** Who the kernel charges a machine's per-user counters (inotify, message queues, signals) to. */
  kernel_quotas: "per-machine" | "shared" | "gvisor";
  detail: string;
}

export interface IdentityOptions {
  runtime: "runc" | "runsc";
  /** `shared` keeps every machine on the canonical range with the runtime's own user namespace (the old way). */
  mode: "auto" | "shared";
  /** Where the mount helper is compiled (shared by servers with one cache dir). */
  helperDir: string;
  /** The host-wide directory of range claims. */
  rangesDir: string;
  /** Probed for idmapped-mount support at start (the data dir); layers on other filesystems are probed as met. */
  probeDirs: string[];
  log: Logger;
}

/** The host's per-user allowances (init namespace): what each machine gets in total when charged to its own uid. */
function hostCounters(): Record<(typeof COUNTERS)[number], number> {
  const read = (name: string) => Number(readFileSync(`/proc/sys/user/${name}`, "utf8").trim()) || 0;
  return Object.fromEntries(COUNTERS.map((c) => [c, existsSync(`/proc/sys/user/${c}`) ? read(c) : 0])) as Record<(typeof COUNTERS)[number], number>;
}

export function createMachineIdentities(opts: IdentityOptions) {
  const pool = createIdRangePool({ dir: opts.rangesDir, log: opts.log });
  const counters = hostCounters();
  const perUid: Record<string, number> = {};
  for (const c of COUNTERS) if (counters[c] > 1) perUid[c] = Math.max(1, Math.floor(counters[c] * PER_UID_SHARE));
  /** Filesystems (by st_dev) seen to take idmapped mounts, or not. */
  const devices = new Map<number, boolean>();

  const setup: Promise<{ helper: Helper; idmap: { ok: true } | { ok: false; problem: string } }> = (async () => {
    if (opts.mode === "shared") return { helper: { problem: "KILN_MACHINE_IDENTITY=shared" }, idmap: { ok: false, problem: "KILN_MACHINE_IDENTITY=shared" } };
    const helper = await prepareIdmountHelper(opts.helperDir);
    if (helper.path === undefined) return { helper, idmap: { ok: false as const, problem: helper.problem } };
    for (const dir of opts.probeDirs) await mkdir(dir, { recursive: true });
    const idmap = await probeIdmappedMounts(helper.path, opts.probeDirs);
    for (const dir of opts.probeDirs) devices.set(statSync(dir).dev, idmap.ok);
    return { helper, idmap };
  })();
  setup.catch(() => undefined);

  /** Whether every layer's filesystem takes idmapped mounts (each filesystem probed once). */
  async function layersIdmappable(helper: string, layers: string[]): Promise<boolean> {
    for (const layer of layers) {
      if (!existsSync(layer)) throw new Error(`template layer ${layer} is missing`);
      const dev = statSync(layer).dev;
      if (!devices.has(dev)) devices.set(dev, (await probeIdmappedMounts(helper, [layer])).ok);
      if (!devices.get(dev)) return false;
    }
    return true;
  }

  async function read(machineDir: string): Promise<MachineIdentity> {
    const text = await readFile(join(machineDir, RECORD), "utf8").catch(() => undefined);
    return text ? (JSON.parse(text) as MachineIdentity) : SHARED_IDENTITY;
  }

  return {
    /** Decides a new machine's identity (claiming its range) and records it in its dir, which must exist. */
    async assign(machineDir: string, layers: string[]): Promise<MachineIdentity> {
      const { helper, idmap } = await setup;
      // gVisor cannot join a user namespace by path, so only an idmapped range needs the helper (and a claim) there.
      const ownNamespace = helper.path !== undefined && opts.runtime === "runc";
      const idmapped = helper.path !== undefined && idmap.ok && (await layersIdmappable(helper.path, layers));
      if (!ownNamespace && !idmapped) return SHARED_IDENTITY;
      const range = await pool.claim(machineDir);
      const base = rangeBase(range);
      const identity: MachineIdentity = { hostBase: idmapped ? base : CANONICAL_BASE, range, idmapped, ...(ownNamespace ? { owner: base } : {}) };
      await writeFile(join(machineDir, RECORD), JSON.stringify(identity));
      return identity;
    },

    read,

    /** Gives the machine's range back to the pool (`ifIdle`: unless a process runs on it); call before its dir is removed. */
    async release(machineDir: string, opts: { ifIdle?: boolean } = {}): Promise<void> {
      const identity = await read(machineDir);
      if (identity.range !== undefined) await pool.release(identity.range, machineDir, opts);
    },

    /** Whether booting this machine goes through the mount helper (else: the runtime alone, as before). */
    usesHelper(identity: MachineIdentity): boolean {
      return identity.idmapped || identity.owner !== undefined;
    },

    /**
     * The runtime's command line for one boot of the machine, behind the helper: it makes the machine's user
     * namespace (runc), mounts the overlay root (unless mounted) and the idmapped volume binds, then runs the runtime.
     */
    async command(
      identity: MachineIdentity,
      boot: { dir: string; layers: string[]; disk: string; rootfs: string | undefined; binds: { source: string; target: string; readOnly: boolean }[]; nofile: { soft: number; hard: number } },
      runtime: [string, string[]],
    ): Promise<[string, string[]]> {
      const { helper } = await setup;
      if (!helper.path) throw new Error(`machine ${boot.dir} needs the mount helper: ${helper.problem}`);
      const plan: BootPlan = {
        userns:
          identity.owner !== undefined
            ? { file: usernsFile(boot.dir), owner: identity.owner, hostBase: identity.hostBase, sysctl: perUid, rlimit: MACHINE_RLIMITS }
            : undefined,
        idmap: identity.idmapped ? { canonical: CANONICAL_BASE, hostBase: identity.hostBase, count: ID_RANGE } : undefined,
        root: boot.rootfs ? { scratch: scratchDir(boot.dir), layers: boot.layers, disk: boot.disk, rootfs: boot.rootfs } : undefined,
        binds: boot.binds,
        // The runtime cannot set rlimits in a user namespace it did not make (without CAP_SYS_RESOURCE): the machine
        // inherits the helper's instead.
        nofile: identity.owner !== undefined ? boot.nofile : undefined,
      };
      return bootCommand(helper.path, plan, runtime);
    },

    /**
     * runc: gives the machine running as `pid` another disk image (`root.image`.taking, or a reflink of
     * `root.cloneFrom`) — or, without `image`, new upper and work dirs on its own disk — mounts its overlay root again
     * over it and swaps that in as its root, its processes running on (see --swap-into in idmount.c).
     */
    async swapRoot(identity: MachineIdentity, root: { dir: string; layers: string[]; disk: string; rootfs: string; image?: string; cloneFrom?: string; upper?: { upper: string; work: string } }, pid: number): Promise<void> {
      const { helper } = await setup;
      if (!helper.path) throw new Error(`swapping the root of a running machine needs the mount helper: ${helper.problem}`);
      if (opts.runtime !== "runc") throw new Error("only a runc machine's root can be swapped while it runs");
      const plan = {
        idmap: identity.idmapped ? { canonical: CANONICAL_BASE, hostBase: identity.hostBase, count: ID_RANGE } : undefined,
        root: { scratch: scratchDir(root.dir), layers: root.layers, disk: root.disk, rootfs: root.rootfs },
        image: root.image,
        cloneFrom: root.cloneFrom,
        upper: root.upper,
      };
      const [command, args] = swapCommand(helper.path, plan, pid);
      try {
        await exec(command, args, { timeout: 10_000 });
      } catch (err) {
        const e = err as { stderr?: string; message: string };
        throw new Error(`swapping the root of ${root.dir} failed: ${(e.stderr || e.message).trim().slice(0, 300)}`);
      }
    },

    /** The mount helper's path, where it could be made. */
    async helperPath(): Promise<string | undefined> {
      return (await setup).helper.path;
    },

    /** What a machine's runtime spec needs: its host ids, and the namespace to join (runc with its own). */
    specIds(identity: MachineIdentity, machineDir: string): { hostBase: number; usernsPath?: string } {
      return { hostBase: identity.hostBase, ...(identity.owner !== undefined ? { usernsPath: usernsFile(machineDir) } : {}) };
    },

    /** Mounts the helper leaves only when killed mid-boot (the pinned namespace, idmapped binds). */
    async unmountLeftovers(machineDir: string): Promise<void> {
      const prefix = [usernsFile(machineDir), scratchDir(machineDir) + "/"];
      const targets = leftoverMounts(prefix);
      if (targets.length) await exec("umount", ["-l", ...targets]).catch(() => undefined);
    },

    async readiness(): Promise<IdentityReadiness> {
      const { helper, idmap } = await setup;
      const gvisor = opts.runtime === "runsc";
      const quotas = gvisor
        ? "gVisor keeps inotify, message queues and signals inside each sandbox's own kernel"
        : helper.path
          ? `each machine's user namespace belongs to its own host uid: per machine ${counters.max_inotify_instances} inotify instances and ${counters.max_inotify_watches} watches (${perUid.max_inotify_instances ?? "-"}/${perUid.max_inotify_watches ?? "-"} per uid inside), ${MACHINE_RLIMITS.msgqueue} bytes of message queues, ${MACHINE_RLIMITS.sigpending} pending signals`
          : "every machine's user namespace belongs to host root: machines share root's per-user kernel counters";
      if (idmap.ok) {
        return {
          uid_ranges: "per-machine",
          idmapped_mounts: true,
          kernel_quotas: gvisor ? "gvisor" : "per-machine",
          detail: `each machine runs on its own ${ID_RANGE} host ids (${rangeBase(1)} up to ${rangeBase(ID_POOL_LAST) + ID_RANGE - 1}); layers, disks and volumes stay stored at ${CANONICAL_BASE}+ and are seen through idmapped mounts; ${quotas}`,
        };
      }
      return {
        uid_ranges: "shared",
        idmapped_mounts: false,
        kernel_quotas: gvisor ? "gvisor" : helper.path ? "per-machine" : "shared",
        detail: `every machine runs on host ids ${CANONICAL_BASE}–${CANONICAL_BASE + ID_RANGE - 1} (${idmap.problem}); ${quotas}`,
      };
    },
  };
}

export type MachineIdentities = ReturnType<typeof createMachineIdentities>;

function usernsFile(machineDir: string): string {
  return join(machineDir, "userns");
}

/** Where the helper attaches idmapped mounts: traversable by machine root, whose runtime binds from it. */
export function scratchDir(machineDir: string): string {
  return join(machineDir, "idmap");
}

function leftoverMounts(prefixes: string[]): string[] {
  const found: string[] = [];
  for (const line of readFileSync("/proc/self/mountinfo", "utf8").split("\n")) {
    const point = line.split(" ")[4]?.replace(/\\(\d{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)));
    if (point && prefixes.some((p) => point === p || point.startsWith(p))) found.push(point);
  }
  return found.sort((a, b) => b.length - a.length);
}
