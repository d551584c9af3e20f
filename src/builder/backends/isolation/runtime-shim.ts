// The OCI runtime Buildah is given for a Dockerfile build's RUN steps (`--runtime`): a shell wrapper calls this on
// `create` to fit the spec Buildah wrote to the build's sandbox, then runc runs it. Standalone: only node: imports.
//
// Buildah decides what a RUN sees (rootfs, mounts, env, args); Kiln decides where it runs. Whatever Buildah wrote,
// the container joins the build's user namespace (host ids 1,000,000,000 + 0…65535) and network namespace (slirp4netns
// behind the egress policy, or loopback only), gets new PID, IPC, UTS, mount and cgroup namespaces, lives in the
// build's cgroup with its memory, CPU and pids limits, and has the same masked /proc paths machines have.

import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

/** What the sandbox writes for the shim (sandbox.ts); one file per build, private to host root. */
export interface RunPolicy {
  userns: string;
  netns: string;
  idMap: { containerID: number; hostID: number; size: number };
  /** Each RUN container's cgroup is `<cgroupParent>/<container id>`. */
  cgroupParent: string;
  memoryBytes: number;
  /** The host accounts swap per cgroup: memory + swap is capped at the same bound. */
  limitSwap: boolean;
  cpuQuota: number;
  cpuPeriod: number;
  pidsLimit: number;
}

const MASKED = ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap"];
const READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"];

interface Spec {
  process?: { oomScoreAdj?: number };
  linux?: {
    namespaces?: { type: string; path?: string }[];
    uidMappings?: unknown;
    gidMappings?: unknown;
    cgroupsPath?: string;
    resources?: Record<string, unknown>;
    maskedPaths?: string[];
    readonlyPaths?: string[];
  };
}

/** The spec fitted to the policy: pure, so the tests can check it without runc. */
export function fitSpec(spec: Spec, policy: RunPolicy, containerId: string): Spec {
  if (!/^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$/.test(containerId)) throw new Error(`unexpected container id ${JSON.stringify(containerId)}`);
  const linux = (spec.linux ??= {});
  linux.namespaces = [
    { type: "pid" },
    { type: "ipc" },
    { type: "uts" },
    { type: "mount" },
    { type: "cgroup" },
    { type: "user", path: policy.userns },
    { type: "network", path: policy.netns },
  ];
  // runc checks these against the namespace it joins.
  linux.uidMappings = [policy.idMap];
  linux.gidMappings = [policy.idMap];
  linux.cgroupsPath = `${policy.cgroupParent}/${containerId}`;
  linux.resources = {
    ...linux.resources,
    memory: { limit: policy.memoryBytes, ...(policy.limitSwap ? { swap: policy.memoryBytes } : {}) },
    cpu: { quota: policy.cpuQuota, period: policy.cpuPeriod },
    pids: { limit: policy.pidsLimit },
  };
  linux.maskedPaths = [...new Set([...(linux.maskedPaths ?? []), ...MASKED])];
  linux.readonlyPaths = [...new Set([...(linux.readonlyPaths ?? []), ...READONLY])];
  // Under memory pressure on the host, a build's processes go before machines and the server.
  spec.process = { ...spec.process, oomScoreAdj: 1000 };
  return spec;
}

/** `node runtime-shim.ts <policy.json> <runc args…>`: rewrites the bundle's config.json of a `create`. */
function main(argv: string[]) {
  const [policyFile, ...args] = argv;
  const policy = JSON.parse(readFileSync(policyFile, "utf8")) as RunPolicy;
  const at = args.indexOf("create");
  let bundle = process.cwd();
  for (let i = at + 1; i < args.length; i++) {
    if (args[i] === "--bundle" || args[i] === "-b") bundle = args[++i];
    else if (args[i].startsWith("--bundle=")) bundle = args[i].slice("--bundle=".length);
  }
  const containerId = args.at(-1)!;
  const file = join(bundle, "config.json");
  const spec = JSON.parse(readFileSync(file, "utf8")) as Spec;
  writeFileSync(file, JSON.stringify(fitSpec(spec, policy, containerId)));
}

if (import.meta.main) {
  try {
    main(process.argv.slice(2));
  } catch (err) {
    process.stderr.write(`kiln: the RUN step's sandbox could not be applied: ${(err as Error).message}\n`);
    process.exit(1);
  }
}
