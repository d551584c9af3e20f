// Single flight with freshness: callers share one run, and no caller gets an answer begun before it asked. A run
// begins once the event loop has read the I/O that is already waiting (setImmediate), so the requests parsed in one
// turn of the loop share a run begun after all of them arrived; callers that arrive while a run is in flight wait for
// the next one. Runs begin at least `minIntervalMs` apart (0: one per loop turn at most).

export function coalesce<T>(run: () => Promise<T>, minIntervalMs = 0): () => Promise<T> {
  let running: Promise<T> | undefined;
  let startedAt = -Infinity;
  /** The run the callers that have not been served yet will share. */
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

  const settled = (p: Promise<T> | undefined) =>
    (p ?? Promise.resolve()).then(
      () => undefined,
      () => undefined,
    );

  return () => {
    if (next) return next;
    next = new Promise<void>((resolve) => setImmediate(resolve))
      .then(() => settled(running))
      .then(() => {
        const wait = startedAt + minIntervalMs - performance.now();
        return wait > 0 ? new Promise<void>((resolve) => setTimeout(resolve, wait)) : undefined;
      })
      .then(() => {
        next = undefined;
        return start();
      });
    return next;
  };
}
