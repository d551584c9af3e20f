// The control plane's watch loop over supervised services: one timer per service that runs its check, waits for it
// to finish and schedules the next, so checks of one service never overlap and a slow one delays only itself.

export class Supervisor {
  private readonly timers = new Map<string, NodeJS.Timeout | "running">();
  private readonly stopped = new Set<string>();
  private closed = false;

  private readonly onError: (id: string, err: unknown) => void;

  constructor(onError: (id: string, err: unknown) => void) {
    this.onError = onError;
  }

  /** Checks `id` every `intervalMs` (first check after `firstMs`) until unwatch(); watching twice is a no-op. */
  watch(id: string, intervalMs: number, check: () => Promise<void>, firstMs = intervalMs) {
    if (this.closed) return;
    if (this.timers.has(id)) {
      this.stopped.delete(id); // unwatched while its check ran: keep it going
      return;
    }
    const schedule = (ms: number) => {
      const t = setTimeout(() => {
        this.timers.set(id, "running");
        check()
          .catch((err: unknown) => this.onError(id, err))
          .finally(() => {
            if (this.closed || this.stopped.has(id)) {
              this.timers.delete(id);
              this.stopped.delete(id);
            } else schedule(intervalMs);
          });
      }, ms);
      t.unref();
      this.timers.set(id, t);
    };
    schedule(firstMs);
  }

  unwatch(id: string) {
    const t = this.timers.get(id);
    if (t === undefined) return;
    if (t === "running") this.stopped.add(id);
    else {
      clearTimeout(t);
      this.timers.delete(id);
    }
  }

  watching(id: string): boolean {
    return this.timers.has(id) && !this.stopped.has(id);
  }

  close() {
    this.closed = true;
    for (const t of this.timers.values()) if (t !== "running") clearTimeout(t);
    this.timers.clear();
  }
}
