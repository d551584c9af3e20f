// Where git runs keep their scratch (credentials in memory, helpers on disk), apart from git.ts: the sweep runs at
// every agent start, and git.ts itself loads only on a machine's first git run.

import { readdir, rm } from "node:fs";
import { promisify } from "node:util";
import { tmpdir } from "node:os";
import { join } from "node:path";

export const SCRATCH_PREFIX = "kiln-git-";
/** The machine's memory filesystem (a tmpfs in every machine's spec, runc and gVisor): secrets are written only here. */
export const SECRETS_ROOT = "/dev/shm";

/**
 * Scratch directories left by an agent that died mid-operation (the machine kept running): removed at start. Through
 * node:fs, not node:fs/promises, which a boot would otherwise load for this alone (≈ 1 ms and 0.25 MiB).
 */
export async function sweepScratch(): Promise<void> {
  for (const dir of [tmpdir(), SECRETS_ROOT]) {
    for (const name of await promisify(readdir)(dir).catch(() => [] as string[])) {
      if (name.startsWith(SCRATCH_PREFIX)) await promisify(rm)(join(dir, name), { recursive: true, force: true }).catch(() => undefined);
    }
  }
}
