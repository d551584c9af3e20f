// A machine's resource use from the host: CPU and memory from its cgroup (/kiln/<id>, v1 or v2), disk from the
// filesystem of its writable layer (its own ext4 image, so statfs is exactly the machine's disk).

import { readFile, statfs } from "node:fs/promises";
import type { MachineUsage } from "../driver.ts";
import type { CgroupSupport } from "./cgroups.ts";

const CG = "/sys/fs/cgroup";

async function read(file: string): Promise<string | undefined> {
  return readFile(file, "utf8").catch(() => undefined);
}

/** A `key value` line of a cgroup stat file. */
function field(text: string | undefined, key: string): number | null {
  const m = text === undefined ? null : new RegExp(`^${key} (\\d+)$`, "m").exec(text);
  return m ? Number(m[1]) : null;
}

export async function machineUsage(cgroups: CgroupSupport, id: string, layerMount: string): Promise<MachineUsage> {
  const path = `kiln/${id}`;
  let cpuNs: number | null = null;
  let memoryBytes: number | null = null;
  let memoryCacheBytes: number | null = null;
  if (cgroups.version === "v2") {
    const [cpu, current, stat] = await Promise.all([read(`${CG}/${path}/cpu.stat`), read(`${CG}/${path}/memory.current`), read(`${CG}/${path}/memory.stat`)]);
    const usec = field(cpu, "usage_usec");
    cpuNs = usec === null ? null : usec * 1000;
    memoryBytes = current === undefined ? null : Number(current.trim());
    memoryCacheBytes = field(stat, "file");
  } else if (cgroups.version !== "none") {
    const [cpu, usage, stat] = await Promise.all([read(`${CG}/cpuacct/${path}/cpuacct.usage`), read(`${CG}/memory/${path}/memory.usage_in_bytes`), read(`${CG}/memory/${path}/memory.stat`)]);
    cpuNs = cpu === undefined ? null : Number(cpu.trim());
    memoryBytes = usage === undefined ? null : Number(usage.trim());
    memoryCacheBytes = field(stat, "total_cache") ?? field(stat, "cache");
  }
  let diskUsedBytes: number | null = null;
  let diskTotalBytes: number | null = null;
  const fs = await statfs(layerMount).catch(() => undefined);
  if (fs) {
    diskTotalBytes = fs.blocks * fs.bsize;
    diskUsedBytes = (fs.blocks - fs.bfree) * fs.bsize;
  }
  return { cpuNs, memoryBytes, memoryCacheBytes, diskUsedBytes, diskTotalBytes };
}
