// The MachineDriver seam: everything about how a machine is isolated and kept alive lives behind it.
// Code above this file never branches on which driver (or OCI runtime) it has.

/** The size of a machine's writable layer unless it asks for another (the warm pool's machines have this one). */
export const DEFAULT_DISK_MB = 10_240;

/** Per-machine egress rules on top of the default (no host, link-local or private ranges); CIDRs, validated. */
export interface EgressRules {
  allowOut: string[];
  denyOut: string[];
}

export interface MachineSpec {
  /** Kiln machine id (`mch_…`); drivers use it to name their runtime objects. */
  id: string;
  /** Read-only template layer directories, lowest first, owned in the canonical uid range (see oci/idmap.ts). */
  layers: string[];
  hostname: string;
  vcpus: number;
  memoryMb: number;
  /** Size of the filesystem holding the machine's writable layer (default DEFAULT_DISK_MB): writes past it fail with ENOSPC. */
  diskMb?: number;
  /** Outbound network through NAT; false leaves the machine with loopback only. */
  internet: boolean;
  /** Opens (allowOut) or closes (denyOut) destinations beyond the default egress policy. */
  network?: EgressRules;
  /** Host directories bind-mounted into the machine (volumes); read-write unless `readOnly`. */
  mounts: { hostPath: string; guestPath: string; readOnly?: boolean }[];
  /** Continue a checkpointed machine instead of booting one (drivers with `checkpoint` only). */
  restore?: MachineCheckpoint;
  /**
   * Start from a snapshot: the machine's disk is a copy of the snapshot's (its size is the snapshot's), and with
   * `memory` its processes continue where the snapshot saved them instead of booting.
   */
  fromSnapshot?: { disk: string; memory?: string | null };
}

/** A machine's state saved by `snapshot`: a copy of its disk and, with memory, a runtime checkpoint of its processes. */
export interface SavedSnapshot {
  /** The disk image (copy-on-write where the host can reflink). */
  disk: string;
  /** The checkpoint image dir of a memory snapshot; null for a disk-only one. */
  memory: string | null;
  /** Bytes the snapshot holds on the host: the disk image's allocated blocks plus the checkpoint. */
  sizeBytes: number;
  /** The runtime and guest runtime a memory snapshot's processes were saved under: a restore needs both as they were. */
  runtime: string;
  guestRuntime: string;
  /**
   * When the snapshot's files were complete before the machine went on (a memory snapshot: the machine is restored
   * from the image just saved after the answer): settles once it runs again. Until then its agent cannot be reached;
   * a rejection means it did not come back.
   */
  continued?: Promise<void>;
}

/** How a machine sleeps: `freeze` keeps its processes in memory; `disk` stops them; `memory` saves them to disk. */
export type HibernateMode = "freeze" | "disk" | "memory";

/** A running machine saved by `checkpoint`: its memory image and its writable layer at that moment. */
export interface MachineCheckpoint {
  imageDir: string;
  /** Laid over the machine's layers as the highest read-only layer, so the restored processes find their files. */
  upperDir: string;
  /** Whether the machine had a network: a restore keeps the saved network stack, so only a like machine can take it. */
  internet: boolean;
  /** The guest runtime (agent, node) the saved processes run: a restore reopens its files, so they must not change. */
  guestRuntime: string;
}

export type LiveState = "running" | "paused";

export interface LiveMachine {
  id: string;
  state: LiveState;
  /** Host path of the unix socket the guest agent listens on. */
  agentSocket: string;
  /** Host pid of the machine's first process. */
  pid: number;
  /**
   * A machine restored from another machine's checkpoint answers before it has its own name: this settles (or fails)
   * once it has. Its agent may be called meanwhile (nothing there reads the name); it is handed out only after.
   */
  renamed?: Promise<void>;
}

/** A machine's resource use as the host sees it; a figure the host cannot read is null. */
export interface MachineUsage {
  /** CPU time the machine's processes used since it started, in nanoseconds (cumulative). */
  cpuNs: number | null;
  /** Memory charged to the machine, page cache included, and the page cache alone, in bytes. */
  memoryBytes: number | null;
  memoryCacheBytes: number | null;
  /** Bytes used on the machine's writable layer and its size. */
  diskUsedBytes: number | null;
  diskTotalBytes: number | null;
}

/**
 * What heal() found: `repaired` names what was put right (a restarted network helper, a trimmed log); `ok: false`
 * says why the machine cannot work any more (the caller then destroys it with that reason).
 */
export type MachineHealth = { ok: true; repaired: string[] } | { ok: false; reason: string };

/** What the host can enforce, reported as-is by GET /v1/ready. */
export interface DriverReadiness {
  driver: string;
  runtime: string;
  ready: boolean;
  detail: string;
  /** Whose host ids machines run on and who the kernel charges their per-user counters to. */
  identity: {
    uid_ranges: "per-machine" | "shared";
    idmapped_mounts: boolean;
    kernel_quotas: "per-machine" | "shared" | "gvisor";
    detail: string;
  };
  cgroup: { version: "v1" | "v2" | "hybrid" | "none"; enforced: string[] };
  network: string;
}

export interface MachineDriver {
  readonly name: string;
  readiness(): Promise<DriverReadiness>;
  /** Prepares the machine's root and bundle and starts it; resolves once the guest agent answers. */
  create(spec: MachineSpec): Promise<LiveMachine>;
  /** Stops the machine's processes but keeps its root (a later start reboots it). */
  stop(id: string): Promise<void>;
  start(id: string): Promise<LiveMachine>;
  /**
   * `freeze` (default): freezes every process in place. `disk`: stops the machine, keeping its disk (a later resume
   * boots it again). `memory`: saves its processes to disk and stops it, so it holds no memory (where
   * memorySnapshotsUnsupported() says nothing). A `disk` or `memory` machine is not in listLive() until resumed.
   */
  hibernate(id: string, mode?: HibernateMode): Promise<void>;
  /** Continues a hibernated machine by the mode it was hibernated with. */
  resume(id: string, mode?: HibernateMode): Promise<LiveMachine>;
  /** Why this host cannot save machines' memory (snapshots with memory, memory hibernation); undefined when it can. */
  memorySnapshotsUnsupported(): string | undefined;
  /**
   * Saves a running or frozen machine's disk (copy-on-write where it can) and with `memory` its processes, as
   * snapshot `snapshotId`. The machine goes on as it was (at once, or once `continued` settles).
   */
  snapshot(id: string, snapshotId: string, opts: { memory: boolean }): Promise<SavedSnapshot>;
  /** Removes a snapshot's files. Idempotent. */
  deleteSnapshot(snapshotId: string): Promise<void>;
  /** Snapshots whose files are on this host (to remove what no record names after a crash). */
  listSnapshots(): Promise<string[]>;
  /**
   * Copies the files a snapshot's machine had written (its writable layer) to `destDir` as a read-only template layer
   * (overlayfs form, the machines' uid range): a snapshot as a template build's base. The snapshot is not changed.
   */
  snapshotLayer(snapshotId: string, destDir: string): Promise<void>;
  /** Whether a memory snapshot can continue here (same runtime and guest runtime as when it was saved). */
  canRestoreSnapshot(saved: { memory: string | null; guestRuntime: string }): boolean;
  /**
   * Stops a (build) machine and moves its writable layer to `destDir` as a read-only template layer (already in
   * overlayfs form and the machines' uid range), then removes the machine like destroy.
   */
  captureLayer(id: string, destDir: string): Promise<void>;
  /**
   * A build machine's step is done: every process the step started is killed (the machine frozen first, so none forks
   * away; only its first processes, the init and the agent, stay), and its writable layer is copied to `destDir` as
   * captureLayer copies it. The machine keeps running on the same root. Absent, with renewLayer, where the runtime
   * cannot swap a running machine's root (runsc): there each step boots its own build machine.
   */
  copyLayer?(id: string, destDir: string): Promise<void>;
  /**
   * Gives a running build machine whose step processes are gone (copyLayer) a new, empty writable layer over `layers`,
   * swapped in under its running init and agent: the next step runs without a reboot. On failure the caller destroys it.
   */
  renewLayer?(id: string, layers: string[]): Promise<void>;
  /**
   * Saves the running machine (every process, its memory, its writable layer) under `destDir` and stops it, for
   * `create({ restore })` to continue. Absent where the runtime cannot (runc: CRIU fails on this host's kernel).
   */
  checkpoint?(id: string, destDir: string): Promise<MachineCheckpoint>;
  /** Whether `create({ restore })` can continue this checkpoint here (runtime, guest runtime and image as saved). */
  canRestore?(saved: MachineCheckpoint): boolean;
  /**
   * Why a machine whose processes are gone died, as far as the host can tell: "out_of_memory" when the kernel's OOM
   * killer killed in its memory cgroup. Must be asked before destroy (which removes the cgroup).
   */
  deathCause(id: string): Promise<"out_of_memory" | undefined>;
  /**
   * Checks what a live machine needs on the host besides its own processes (its network helper, the host files it
   * writes) and repairs what it can. Called every few seconds for every running or hibernated machine, and at start.
   */
  heal(id: string): Promise<MachineHealth>;
  /**
   * Replaces a machine's egress lists, kept for its next boots and applied at once while it runs (a machine without
   * internet keeps them for nothing: it has no network to filter).
   */
  updateNetwork?(id: string, network: EgressRules | undefined): Promise<void>;
  /** Reads the machine's resource use now (cgroup counters and its disk). */
  usage(id: string): Promise<MachineUsage>;
  /**
   * Leaves no process, mount or directory behind. Idempotent. `leftover`: what a crash left of a machine nothing
   * knows; its uid range goes back only once no host process runs on it.
   */
  destroy(id: string, opts?: { leftover?: boolean }): Promise<void>;
  /**
   * Makes a machine unreachable at once, the first half of a destroy: a marker in its dir says it is going, and its
   * processes are killed (frozen first, so none forks away). What is left (runtime state, network, cgroups, mounts,
   * disk, uid range) is destroy's, run behind the request — or by the next start if the server dies first. Absent
   * where a driver has no faster way than destroy itself.
   */
  silence?(id: string): Promise<void>;
  /**
   * Gives a running machine new vcpus and memory (its cgroup caps, and its saved spec, so a later boot keeps them):
   * how a machine booted ahead of time is handed out in any size. Absent where a machine cannot be resized live
   * so that it sees the new size (runsc sizes the sandbox's kernel at boot).
   */
  resize?(id: string, limits: { vcpus: number; memoryMb: number }): Promise<void>;
  /**
   * Gives a running machine booted ahead of time (nothing of a caller's in it yet) a copy of a snapshot's disk as its
   * own disk and root, its first processes going on there: a machine from a disk snapshot without a boot. Absent
   * where the runtime cannot (runsc: its sentry does not see host mounts made after it started). On failure the
   * machine is left unusable: the caller destroys it.
   */
  takeSnapshotDisk?(id: string, snapshotDisk: string): Promise<void>;
  /** Machines this driver still has alive on the host (used to adopt them after a restart). */
  listLive(): Promise<LiveMachine[]>;
  /** Ids of every machine this driver has anything of on the host (a dir), alive or not: what a crash may leave. */
  listKnown?(): Promise<string[]>;
  /** Releases host resources the driver holds open (not the machines). */
  close(): Promise<void>;
}
