// Single flight with freshness: callers that arrive while a run is in flight wait for the next run and share it, so
// a burst of identical reads costs one run per batch, and no caller gets an answer begun before it asked. Runs begin
// at least `minIntervalMs` apart, so a steady stream of callers is served in batches rather than one run each.

export function coalesce<T>(run: () => Promise<T>, minIntervalMs = 0): () => Promise<T> {
  let running: Promise<T> | undefined;
  let startedAt = -Infinity;
  /** The run the callers waiting behind `running` (or the interval) will share. */
  let next: Promise<T> | undefined;

  function start(): Promise<T> {
    startedAt = performance.now();
    const p = run();
    running = p;
    const clear = () => {
      if (running === p) running = undefined;
    };
    p.then(clear, clear);
    return p;
  }

  return () => {
    if (next) return next;
    const wait = startedAt + minIntervalMs - performance.now();
    if (!running && wait <= 0) return start();
    const settled = (running ?? Promise.resolve()).then(
      () => undefined,
      () => undefined,
    );
    next = settled
      .then(() => new Promise<void>((resolve) => (wait > 0 ? setTimeout(resolve, wait) : resolve())))
      .then(() => {
        next = undefined;
        return start();
      });
    return next;
  };
}
