// What a machine leaves on the host, looked up from outside Kiln: its dir and disk image, mounts, processes, cgroups
// in every hierarchy, loop devices and its uid range claim. Empty once a destroy (and its cleanup) is done.

import { execFileSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";

const RANGES = "/var/lib/kiln/id-ranges";

/** Host processes whose command line names `needle` (a machine's id or dir). */
function processesNaming(needle: string): string[] {
  const out: string[] = [];
  for (const d of readdirSync("/proc")) {
    if (!/^\d+$/.test(d) || Number(d) === process.pid) continue;
    try {
      const cmd = readFileSync(`/proc/${d}/cmdline`, "utf8").replaceAll("\0", " ");
      if (cmd.includes(needle)) out.push(`${d}: ${cmd}`);
    } catch {
      // gone meanwhile
    }
  }
  return out;
}

/** Everything of machine `id` (of the server on `dataDir`) still on the host, as readable lines; empty when none. */
export function remainsOf(dataDir: string, id: string): string[] {
  const left: string[] = [];
  const dir = join(dataDir, "machines", id);
  if (existsSync(dir)) left.push(`dir ${dir}`);
  if (existsSync(join(dataDir, "disks", "machines", `${id}.img`))) left.push("disk image");
  for (const line of readFileSync("/proc/self/mountinfo", "utf8").split("\n")) if (line.includes(id)) left.push(`mount ${line}`);
  for (const p of processesNaming(dir)) left.push(`process ${p}`);
  for (const p of processesNaming(`${id} `)) if (!p.includes("node ")) left.push(`process ${p}`);
  for (const c of readdirSync("/sys/fs/cgroup")) if (existsSync(join("/sys/fs/cgroup", c, "kiln", id))) left.push(`cgroup ${c}/kiln/${id}`);
  const loops = execFileSync("losetup", ["-a"], { encoding: "utf8" });
  for (const line of loops.split("\n")) if (line.includes(`${id}.img`)) left.push(`loop ${line}`);
  for (const name of existsSync(RANGES) ? readdirSync(RANGES) : []) {
    const claim = (() => {
      try {
        return readFileSync(join(RANGES, name), "utf8");
      } catch {
        return "";
      }
    })();
    if (claim.includes(dir)) left.push(`uid range claim ${name}`);
  }
  return left;
}

