// The OCI runtime spec (config.json) of a machine: the guest agent as its first process under tini, a user
// namespace mapping machine ids onto the machine's unprivileged host range, Docker's default capabilities, no_new_privileges,
// seccomp, masked /proc paths, cgroup limits, and the binds the platform injects (/opt/kiln, /run/kiln, /etc files).

import { ID_RANGE } from "./idmap.ts";
import { defaultSeccomp } from "./seccomp.ts";
import { EXEC_ONLY_LOADER, EXEC_ONLY_TINI, GUEST_LOADER } from "../guest-runtime.ts";
import { AGENT_ENTRY_FILE } from "../../agent/protocol.ts";

export const GUEST_RUNTIME_PATH = "/opt/kiln";
export const GUEST_RUN_DIR = "/run/kiln";
export const AGENT_SOCKET_NAME = "agent.sock";

/**
 * The machine's init and guest agent start at this OOM score; everything the agent starts raises itself to 1000.
 * Low enough that under memory pressure inside the machine the kernel picks user processes, never the agent (an
 * unprivileged agent cannot go lower than this later); above the control plane's 0, so on the host a machine
 * still goes before the server that serves all of them.
 */
const OOM_SCORE_ADJ = 100;

const CAPS = [
  "CAP_CHOWN",
  "CAP_DAC_OVERRIDE",
  "CAP_FSETID",
  "CAP_FOWNER",
  "CAP_MKNOD",
  "CAP_NET_RAW",
  "CAP_SETGID",
  "CAP_SETUID",
  "CAP_SETFCAP",
  "CAP_SETPCAP",
  "CAP_NET_BIND_SERVICE",
  "CAP_SYS_CHROOT",
  "CAP_KILL",
  "CAP_AUDIT_WRITE",
];

const MASKED = [
  "/proc/acpi",
  "/proc/asound",
  "/proc/kcore",
  "/proc/keys",
  "/proc/latency_stats",
  "/proc/timer_list",
  "/proc/timer_stats",
  "/proc/sched_debug",
  "/proc/scsi",
  "/sys/firmware",
  "/sys/devices/virtual/powercap",
];
const READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"];

export interface SpecInput {
  id: string;
  hostname: string;
  rootfs: string;
  guestRuntimeDir: string;
  runDir: string;
  /**
   * runc: the agent listens on a socket the host created and passes in as fd 3, so its path lives only on the
   * host and machine root cannot swap it for a symlink. runsc cannot take the fd and binds a socket dir instead.
   */
  listenFd: boolean;
  etc: { hosts: string; hostname: string; resolv: string };
  mounts: { hostPath: string; guestPath: string; readOnly?: boolean }[];
  vcpus: number;
  memoryMb: number;
  /** The host accounts swap per cgroup (memsw): the limit then covers memory and swap together. */
  limitSwap: boolean;
  pidsLimit: number;
  /** Open-file limit: machine root cannot raise it past the host's, so the driver passes what the host allows. */
  nofile: number;
  cgroupsPath: string;
  /** runsc has its own kernel: no cgroup namespace, and a seccomp profile it can express (see seccomp.ts). */
  runtime: "runc" | "runsc";
  /** A network namespace made beforehand (runsc with internet); otherwise the runtime makes a new one. */
  netnsPath?: string;
  /**
   * The machine's host ids: machine id 0 is `hostBase`. With `usernsPath` the runtime joins the user namespace the
   * mount helper made (owned by the machine's own host uid, mapped the same way) instead of making one.
   */
  ids: { hostBase: number; usernsPath?: string };
}

/** The machine's soft open-file limit under a hard limit of `hard` (many programs loop up to it when they fork). */
export function machineNofileSoft(hard: number): number {
  return Math.min(hard, 65_536);
}

function bind(source: string, destination: string, readonly: boolean) {
  return { destination, type: "bind", source, options: ["rbind", "nosuid", "nodev", readonly ? "ro" : "rw"] };
}

export function machineSpec(input: SpecInput) {
  const idMap = [{ containerID: 0, hostID: input.ids.hostBase, size: ID_RANGE }];
  const joinsUserns = input.ids.usernsPath !== undefined;
  return {
    ociVersion: "1.0.2",
    process: {
      terminal: false,
      user: { uid: 0, gid: 0 },
      args: [
        // runc: tini and the agent start from files machine root cannot read, so neither is dumpable (see
        // guest-runtime.ts); gVisor cannot exec those, and there the agent drops dumpability itself.
        `${GUEST_RUNTIME_PATH}/${input.runtime === "runc" ? EXEC_ONLY_TINI : "bin/tini"}`,
        "-s",
        "--",
        `${GUEST_RUNTIME_PATH}/${input.runtime === "runc" ? EXEC_ONLY_LOADER : `lib/${GUEST_LOADER}`}`,
        "--library-path",
        `${GUEST_RUNTIME_PATH}/lib`,
        `${GUEST_RUNTIME_PATH}/bin/node`,
        `${GUEST_RUNTIME_PATH}/agent/${AGENT_ENTRY_FILE}`,
        ...(input.listenFd ? ["--listen-fd", "3"] : ["--socket", `${GUEST_RUN_DIR}/${AGENT_SOCKET_NAME}`]),
      ],
      env: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8"],
      cwd: "/",
      capabilities: { bounding: CAPS, effective: CAPS, permitted: CAPS },
      // Without a limit here the machine inherits the control plane's, which may be anything. In a namespace it did
      // not make, the runtime cannot set one (prlimit needs CAP_SYS_RESOURCE there): the helper that made it does.
      ...(joinsUserns ? {} : { rlimits: [{ type: "RLIMIT_NOFILE", hard: input.nofile, soft: machineNofileSoft(input.nofile) }] }),
      noNewPrivileges: true,
      oomScoreAdj: OOM_SCORE_ADJ,
    },
    root: { path: input.rootfs, readonly: false },
    hostname: input.hostname,
    mounts: [
      { destination: "/proc", type: "proc", source: "proc" },
      { destination: "/dev", type: "tmpfs", source: "tmpfs", options: ["nosuid", "strictatime", "mode=755", "size=65536k"] },
      { destination: "/dev/pts", type: "devpts", source: "devpts", options: ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"] },
      { destination: "/dev/shm", type: "tmpfs", source: "shm", options: ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"] },
      { destination: "/dev/mqueue", type: "mqueue", source: "mqueue", options: ["nosuid", "noexec", "nodev"] },
      { destination: "/sys", type: "sysfs", source: "sysfs", options: ["nosuid", "noexec", "nodev", "ro"] },
      { destination: "/sys/fs/cgroup", type: "cgroup", source: "cgroup", options: ["nosuid", "noexec", "nodev", "relatime", "ro"] },
      bind(input.guestRuntimeDir, GUEST_RUNTIME_PATH, true),
      ...(input.listenFd ? [] : [bind(input.runDir, GUEST_RUN_DIR, false)]),
      bind(input.etc.hosts, "/etc/hosts", true),
      bind(input.etc.hostname, "/etc/hostname", true),
      bind(input.etc.resolv, "/etc/resolv.conf", true),
      ...input.mounts.map((m) => bind(m.hostPath, m.guestPath, m.readOnly === true)),
    ],
    linux: {
      uidMappings: idMap,
      gidMappings: idMap,
      namespaces: [{ type: "pid" }, { type: "ipc" }, { type: "uts" }, { type: "mount" }, input.netnsPath ? { type: "network", path: input.netnsPath } : { type: "network" }, joinsUserns ? { type: "user", path: input.ids.usernsPath } : { type: "user" }, ...(input.runtime === "runc" ? [{ type: "cgroup" }] : [])],
      cgroupsPath: input.cgroupsPath,
      resources: {
        devices: [{ allow: false, access: "rwm" }],
        // OCI's swap is memory + swap: equal to the limit, a machine cannot pass its memory limit by swapping.
        memory: { limit: input.memoryMb * 1024 * 1024, ...(input.limitSwap ? { swap: input.memoryMb * 1024 * 1024 } : {}) },
        cpu: { quota: Math.round(input.vcpus * 100_000), period: 100_000 },
        pids: { limit: input.pidsLimit },
      },
      seccomp: defaultSeccomp(input.runtime),
      maskedPaths: MASKED,
      readonlyPaths: READONLY,
    },
  };
}
