// The mount helper (idmount.c) as the driver uses it: compiled with gcc at first use into a cache dir (one binary
// per source version, shared by every server on that cache), probed for idmapped-mount support, and its argv.

import { execFile } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { chmod, mkdir, readFile, rename, rm } from "node:fs/promises";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

const exec = promisify(execFile);
const SOURCE = new URL("./idmount.c", import.meta.url);

/** The helper's path, or why there is none (then the host runs every machine on the shared range, as before). */
export type Helper = { path: string; problem?: undefined } | { path?: undefined; problem: string };

/**
 * Compiles the helper unless this version is already in `dir`. Written aside and renamed into place, so a server
 * never runs a half-written binary and two servers compiling at once both end up with a whole one.
 */
export async function prepareIdmountHelper(dir: string): Promise<Helper> {
  const source = await readFile(SOURCE);
  const version = createHash("sha256").update(source).digest("hex").slice(0, 16);
  const path = join(dir, `kiln-idmount-${version}`);
  if (existsSync(path)) return { path };
  await mkdir(dir, { recursive: true, mode: 0o700 });
  const partial = `${path}.${process.pid}.partial`;
  try {
    await exec("gcc", ["-O2", "-Wall", "-o", partial, fileURLToPath(SOURCE)], { timeout: 60_000 });
    await chmod(partial, 0o700);
    await rename(partial, path);
    return { path };
  } catch (err) {
    await rm(partial, { force: true });
    const e = err as NodeJS.ErrnoException & { stderr?: string };
    const why = e.code === "ENOENT" ? "gcc is not installed (apt-get install gcc libc6-dev)" : `compiling it failed: ${(e.stderr || e.message).trim().slice(0, 300)}`;
    return { problem: `the mount helper is missing: ${why}` };
  }
}

/** Whether every dir's filesystem can be seen through an idmapped mount here; the kernel's reason when not. */
export async function probeIdmappedMounts(helper: string, dirs: string[]): Promise<{ ok: true } | { ok: false; problem: string }> {
  try {
    await exec(helper, ["probe", ...dirs], { timeout: 10_000 });
    return { ok: true };
  } catch (err) {
    const e = err as { stderr?: string; message: string };
    return { ok: false, problem: (e.stderr || e.message).trim().replace(/^kiln-idmount: /, "").slice(0, 300) };
  }
}

export interface BootPlan {
  /** The machine's own user namespace, owned by `owner` and pinned at `file` (runc joins it by path). */
  userns?: { file: string; owner: number; hostBase: number; sysctl: Record<string, number>; rlimit: Record<string, number> };
  /** Canonical ids seen as the machine's: `{canonical, hostBase, count}`; absent on the shared range. */
  idmap?: { canonical: number; hostBase: number; count: number };
  /** The overlay root; absent when it is mounted already. */
  root?: { scratch: string; layers: string[]; disk: string; rootfs: string };
  binds: { source: string; target: string; readOnly: boolean }[];
  nofile?: { soft: number; hard: number };
}

/** The command line that prepares a boot by `plan` and then runs `command` (the runtime). */
export function bootCommand(helper: string, plan: BootPlan, command: [string, string[]]): [string, string[]] {
  const args = ["boot"];
  if (plan.userns) {
    const u = plan.userns;
    args.push("--userns", u.file, "--owner", String(u.owner), "--map", String(u.hostBase));
    for (const [name, value] of Object.entries(u.sysctl)) args.push("--sysctl", `${name}=${value}`);
    for (const [name, value] of Object.entries(u.rlimit)) args.push("--rlimit", `${name}=${value}`);
  }
  if (plan.idmap) args.push("--idmap", `${plan.idmap.canonical}:${plan.idmap.hostBase}:${plan.idmap.count}`);
  if (plan.root) {
    args.push("--scratch", plan.root.scratch, "--disk", plan.root.disk, "--rootfs", plan.root.rootfs);
    for (const layer of plan.root.layers) args.push("--lower", layer);
  }
  for (const b of plan.binds) args.push(b.readOnly ? "--bind-ro" : "--bind", b.source, b.target);
  if (plan.nofile) args.push("--nofile", `${plan.nofile.soft}:${plan.nofile.hard}`);
  return [helper, [...args, "--", command[0], ...command[1]]];
}

/**
 * The helper's command line that gives the running machine whose first process is `pid` a new overlay root at
 * `root.rootfs` and makes it the machine's root (runc: `--swap-into` in idmount.c). With `image`, the machine takes
 * another disk (`image`.taking, or a reflink of `cloneFrom`, becomes `image`, mounted on `root.disk`); without, it
 * keeps its disk and the overlay's upper and work dirs are `upper` and `work` on it (a build machine's next step).
 */
export function swapCommand(helper: string, plan: { idmap?: BootPlan["idmap"]; root: NonNullable<BootPlan["root"]>; image?: string; cloneFrom?: string; upper?: { upper: string; work: string } }, pid: number): [string, string[]] {
  const args = ["boot"];
  if (plan.idmap) args.push("--idmap", `${plan.idmap.canonical}:${plan.idmap.hostBase}:${plan.idmap.count}`);
  args.push("--scratch", plan.root.scratch, "--disk", plan.root.disk, "--rootfs", plan.root.rootfs);
  for (const layer of plan.root.layers) args.push("--lower", layer);
  if (plan.upper) args.push("--upper", plan.upper.upper, "--work", plan.upper.work);
  if (plan.image) args.push("--image", plan.image, ...(plan.cloneFrom ? ["--clone-from", plan.cloneFrom] : []));
  args.push("--swap-into", String(pid));
  return [helper, args];
}
