// The pool of host uid/gid ranges machines run on, shared by every Kiln server on the host: a claim is a file named
// by its pool index in one host-wide directory, made whole and then linked into place (link(2) fails if the index
// is taken), so two servers never hand out one range, and a kill -9 at any moment loses no claim.
//
// A claim names the machine dir it belongs to. Its machine releases it before that dir goes; a claim whose dir is
// gone (a server killed mid-destroy) and whose ids no host process uses is stale, and is swept — by one server at a
// time, under a lock file — at the first claim after a start and whenever the pool seems full. A stale claim never
// becomes live again, and a live one is removed only by its machine, so a sweep never frees a range in use.

import { randomBytes } from "node:crypto";
import { existsSync } from "node:fs";
import { link, mkdir, readFile, readdir, rm, unlink, writeFile } from "node:fs/promises";
import { join } from "node:path";
import type { Logger } from "../../log.ts";
import { ID_POOL_LAST, rangeOf } from "./idmap.ts";
import { pidAlive } from "../pid-alive.ts";

/** How long a sweep waits for another server's, and when a held lock counts as abandoned. */
const LOCK_WAIT_MS = 5_000;
const LOCK_STALE_MS = 60_000;

interface ClaimRecord {
  machine_dir: string;
  claimed_at: string;
  pid: number;
}

export interface IdRangePool {
  /** Claims a free range for the machine at `machineDir` (which must exist already) and returns its index. */
  claim(machineDir: string): Promise<number>;
  /**
   * Frees `index` if (and only if) it is claimed for `machineDir`; call it before that dir is removed. `ifIdle`
   * (what a crash left): not while a host process runs on the range — a sweep frees it once none does.
   */
  release(index: number, machineDir: string, opts?: { ifIdle?: boolean }): Promise<void>;
  /** Frees stale claims; returns how many. */
  sweep(): Promise<number>;
  /** Indices claimed right now, by any server on the host. */
  claimed(): Promise<number[]>;
}

/** How long a leftover's release waits for the last processes of a machine killed a moment ago to be gone. */
const IDLE_WAIT_MS = 3_000;

/**
 * Every host id some live process runs with (real, effective, saved or filesystem), from /proc. A zombie runs
 * nothing and holds nothing a new owner of its ids could reach: it is not counted.
 */
async function processIds(): Promise<Set<number>> {
  const ids = new Set<number>();
  for (const name of await readdir("/proc")) {
    if (!/^\d+$/.test(name)) continue;
    const status = await readFile(`/proc/${name}/status`, "utf8").catch(() => "");
    if (/^State:\s+[ZX]/m.test(status)) continue;
    for (const m of status.matchAll(/^(?:Uid|Gid):\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$/gm)) for (let i = 1; i <= 4; i++) ids.add(Number(m[i]));
  }
  return ids;
}

export function createIdRangePool(opts: { dir: string; log: Logger }): IdRangePool {
  let next = 1;
  let swept: Promise<number> | undefined;

  async function ensureDir() {
    await mkdir(opts.dir, { recursive: true, mode: 0o700 });
  }

  async function readClaim(index: number): Promise<ClaimRecord | undefined> {
    try {
      return JSON.parse(await readFile(join(opts.dir, String(index)), "utf8")) as ClaimRecord;
    } catch {
      return undefined;
    }
  }

  async function claimed(): Promise<number[]> {
    if (!existsSync(opts.dir)) return [];
    return (await readdir(opts.dir)).filter((n) => /^\d+$/.test(n)).map(Number);
  }

  /**
   * The sweep lock, taken with O_EXCL. Another server's sweep is waited for (a sweep takes milliseconds); a lock left
   * by a dead server, or held longer than LOCK_STALE_MS, is taken over.
   */
  async function lockSweep(): Promise<boolean> {
    const lock = join(opts.dir, ".sweep.lock");
    const deadline = Date.now() + LOCK_WAIT_MS;
    for (;;) {
      try {
        await writeFile(lock, JSON.stringify({ pid: process.pid, at: Date.now() }), { flag: "wx", mode: 0o600 });
        return true;
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== "EEXIST") throw err;
        const held = await readFile(lock, "utf8").then((t) => JSON.parse(t) as { pid: number; at: number }).catch(() => undefined);
        if (held && (!pidAlive(held.pid) || Date.now() - held.at > LOCK_STALE_MS)) await rm(lock, { force: true });
        else if (Date.now() > deadline) return false;
        else await new Promise((r) => setTimeout(r, 10));
      }
    }
  }

  async function sweep(): Promise<number> {
    await ensureDir();
    if (!(await lockSweep())) return 0;
    try {
      return await sweepLocked();
    } finally {
      await rm(join(opts.dir, ".sweep.lock"), { force: true });
    }
  }

  async function sweepLocked(): Promise<number> {
    const busy = new Set<number>();
    for (const id of await processIds()) {
      const k = rangeOf(id);
      if (k !== undefined) busy.add(k);
    }
    let freed = 0;
    for (const index of await claimed()) {
      const record = await readClaim(index);
      // A claim is written whole before it is linked: one that cannot be read was damaged outside Kiln.
      if (record && (existsSync(record.machine_dir) || busy.has(index))) continue;
      await unlink(join(opts.dir, String(index))).catch(() => undefined);
      freed++;
    }
    // Temp files of claims a killed server was making.
    for (const name of await readdir(opts.dir)) {
      const pid = /^\.claim-(\d+)-/.exec(name)?.[1];
      if (pid && !pidAlive(Number(pid))) await rm(join(opts.dir, name), { force: true });
    }
    if (freed) opts.log.info({ freed }, "stale uid range claims freed");
    return freed;
  }

  async function tryClaim(machineDir: string): Promise<number | undefined> {
    const record: ClaimRecord = { machine_dir: machineDir, claimed_at: new Date().toISOString(), pid: process.pid };
    const temp = join(opts.dir, `.claim-${process.pid}-${randomBytes(6).toString("hex")}`);
    await writeFile(temp, JSON.stringify(record) + "\n", { mode: 0o600 });
    try {
      for (let tried = 0; tried < ID_POOL_LAST; tried++) {
        const index = next;
        next = next >= ID_POOL_LAST ? 1 : next + 1;
        try {
          await link(temp, join(opts.dir, String(index)));
          return index;
        } catch (err) {
          if ((err as NodeJS.ErrnoException).code !== "EEXIST") throw err;
        }
      }
      return undefined;
    } finally {
      await unlink(temp).catch(() => undefined);
    }
  }

  /**
   * Whether no live process runs in the range, waiting a moment for one: the processes of a machine whose first
   * process was just killed are killed by the kernel a little after it, not with it.
   */
  async function idle(index: number): Promise<boolean> {
    const deadline = Date.now() + IDLE_WAIT_MS;
    for (;;) {
      if (![...(await processIds())].some((id) => rangeOf(id) === index)) return true;
      if (Date.now() > deadline) return false;
      await new Promise((r) => setTimeout(r, 50));
    }
  }

  return {
    claimed,
    sweep,

    async claim(machineDir) {
      // After a start, claims a killed server left go back to the pool before anything is handed out.
      swept ??= sweep();
      await swept;
      const index = (await tryClaim(machineDir)) ?? ((await sweep()) > 0 ? await tryClaim(machineDir) : undefined);
      if (index === undefined) throw new Error(`every uid range of the host's pool (${ID_POOL_LAST}) is taken`);
      return index;
    },

    async release(index, machineDir, releaseOpts = {}) {
      const record = await readClaim(index);
      if (record?.machine_dir !== machineDir) return;
      if (releaseOpts.ifIdle && !(await idle(index))) {
        opts.log.warn({ range: index, machine_dir: machineDir }, "a leftover machine's uid range is kept: a host process still runs on it");
        return;
      }
      await unlink(join(opts.dir, String(index))).catch(() => undefined);
    },
  };
}
