// Teardown off the request path: a destroyed machine's processes are killed and its record written at once (the
// caller is answered then); what is left of it on the host — runtime state, network helper, cgroups, mounts, disk
// image, uid range — is removed here, behind the request, a few at a time, each attempt bounded. The driver's
// marker in the machine's dir makes it crash-safe: a server killed mid-cleanup leaves a dir no live record keeps,
// which the next start removes (adoption.ts). Until its cleanup is done a machine still counts for admission.

import type { MachineDriver } from "../runtime/driver.ts";
import type { Logger } from "../log.ts";

/** Cleanups at once: each is mostly waiting (the runtime's delete, umount, rm), but all of them share two cores. */
const CONCURRENCY = 4;
/** One attempt's bound; past it the cleanup is tried again (the attempt may still finish: destroy is idempotent). */
const ATTEMPT_MS = 60_000;
const ATTEMPTS = 3;
const RETRY_MS = 1000;

export interface Teardown {
  /** Queues the removal of what is left of machine `id` (already unreachable); `memoryMb` counts until it is done. */
  schedule(id: string, memoryMb: number): void;
  /** Machines whose cleanup has not finished, and the memory they were given. */
  pending(): { count: number; memoryMb: number };
  /** Resolves once none of `ids` is being cleaned (bounded by `timeoutMs`; the caller goes on either way). */
  cleaned(ids: string[], timeoutMs?: number): Promise<void>;
  /** Resolves once no cleanup is queued or running (false when `timeoutMs` passed first). */
  settled(timeoutMs?: number): Promise<boolean>;
  /** Stops taking new work and waits (bounded) for what runs; what is left is finished by the next start. */
  close(timeoutMs?: number): Promise<void>;
}

export function createTeardown(deps: { driver: MachineDriver; log: Logger }): Teardown {
  const { driver, log } = deps;
  const queue: string[] = [];
  const pending = new Map<string, number>();
  let running = 0;
  let closed = false;
  const waiters = new Set<() => void>();

  const bounded = <T>(work: Promise<T>, ms: number, what: string) =>
    new Promise<T>((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`${what} took longer than ${ms} ms`)), ms);
      work.then(resolve, reject).finally(() => clearTimeout(timer));
    });

  async function clean(id: string): Promise<void> {
    for (let attempt = 1; ; attempt++) {
      const failed = await bounded(driver.destroy(id), ATTEMPT_MS, `removing what is left of ${id}`).then(
        () => undefined,
        (err: unknown) => err,
      );
      if (failed === undefined) return;
      if (attempt >= ATTEMPTS || closed) {
        log.error({ err: failed, machine_id: id }, "removing what is left of a destroyed machine failed; the next start tries again");
        return;
      }
      log.warn({ err: failed, machine_id: id, attempt }, "removing what is left of a destroyed machine failed; trying again");
      await new Promise((r) => setTimeout(r, RETRY_MS));
    }
  }

  function pump() {
    while (running < CONCURRENCY && queue.length > 0) {
      const id = queue.shift()!;
      running++;
      void clean(id).finally(() => {
        running--;
        pending.delete(id);
        pump();
        if (running === 0 && queue.length === 0) for (const wake of waiters) wake();
      });
    }
  }

  async function settled(timeoutMs = Number.POSITIVE_INFINITY): Promise<boolean> {
    if (running === 0 && queue.length === 0) return true;
    return new Promise<boolean>((resolve) => {
      const done = (ok: boolean) => {
        waiters.delete(wake);
        clearTimeout(timer);
        resolve(ok);
      };
      const wake = () => done(true);
      const timer = Number.isFinite(timeoutMs) ? setTimeout(() => done(false), timeoutMs) : undefined;
      waiters.add(wake);
    });
  }

  return {
    schedule(id, memoryMb) {
      if (pending.has(id)) return;
      pending.set(id, memoryMb);
      queue.push(id);
      // After the caller's answer is on its way: the first step spawns the runtime, which blocks the event loop a moment.
      setImmediate(pump);
    },
    pending() {
      let memoryMb = 0;
      for (const mb of pending.values()) memoryMb += mb;
      return { count: pending.size, memoryMb };
    },
    settled,
    async cleaned(ids, timeoutMs = 60_000) {
      const deadline = Date.now() + timeoutMs;
      while (ids.some((id) => pending.has(id)) && Date.now() < deadline) await settled(Math.min(100, deadline - Date.now()));
    },
    async close(timeoutMs = 30_000) {
      // Queued ones still run (they are quick next to a restart); a cleanup cut off here is the next start's.
      if (!(await settled(timeoutMs))) log.warn({ pending: pending.size }, "server stopping with machine cleanups unfinished; the next start finishes them");
      closed = true;
    },
  };
}
