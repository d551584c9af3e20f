// Per-key serialisation for the services' lifecycle operations: work on one key (a machine, a volume, a service)
// runs one at a time, in call order; work on different keys runs side by side.

export interface KeyedLock {
  /** Runs `fn` after everything already queued for `key` has settled; its result is `fn`'s. */
  run<T>(key: string, fn: () => Promise<T>): Promise<T>;
  /** Settles once everything queued so far has (used on shutdown). */
  drain(): Promise<void>;
}

export function createKeyedLock(): KeyedLock {
  const tails = new Map<string, Promise<unknown>>();
  return {
    run<T>(key: string, fn: () => Promise<T>): Promise<T> {
      const prev = tails.get(key) ?? Promise.resolve();
      const next = prev.then(fn, fn);
      const settled = next.catch(() => undefined);
      tails.set(key, settled);
      void settled.then(() => {
        if (tails.get(key) === settled) tails.delete(key);
      });
      return next;
    },
    async drain() {
      await Promise.all([...tails.values()]);
    },
  };
}
