// Cold boots share the host's cores: a burst larger than the warm pool boots a few machines at a time, in the order
// their creates came, instead of all at once (where every boot slows every other and all finish together, late).
// Only the boot waits here: a create's other steps (its record, its start command) never wait behind another's boot.
// Creates go before the warm pool's refills, which only boot in a slot no create is waiting for.

import { cpus } from "node:os";

export type BootKind = "create" | "pool";

export interface BootQueue {
  /** Runs `boot` once a slot is free (creates first, each kind in arrival order). */
  run<T>(kind: BootKind, boot: () => Promise<T>): Promise<T>;
  /** Boots running now and waiting, for metrics and tests. */
  stats(): { running: number; waiting: number; slots: number };
}

/**
 * Two boots per core: a boot is half waiting (the runtime's processes, the agent's socket), so one per core leaves
 * cores idle, while many more only make each one slower (measured: bench/fleet.bench.ts).
 */
export function defaultBootSlots(): number {
  return Math.max(2, cpus().length * 2);
}

export function createBootQueue(slots = defaultBootSlots()): BootQueue {
  let running = 0;
  const waiting: Record<BootKind, (() => void)[]> = { create: [], pool: [] };

  function next() {
    while (running < slots) {
      const start = waiting.create.shift() ?? waiting.pool.shift();
      if (!start) return;
      running++;
      start();
    }
  }

  return {
    run<T>(kind: BootKind, boot: () => Promise<T>): Promise<T> {
      return new Promise<T>((resolve, reject) => {
        waiting[kind].push(() => {
          boot()
            .then(resolve, reject)
            .finally(() => {
              running--;
              next();
            });
        });
        next();
      });
    },
    stats: () => ({ running, waiting: waiting.create.length + waiting.pool.length, slots }),
  };
}
