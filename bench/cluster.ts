// Servers on one real PostgreSQL, for the benches that measure what several hosts do (hosts, volume-move,
// template-travel): each a Kiln in this process on the same store, quiet (warn) and with no warm pool, closed in the
// reverse order they started, and the database after them, however the bench ends.

import { startTestKiln } from "../test/support/kiln.ts";
import type { TestKiln } from "../test/support/kiln.ts";
import { startPostgres } from "../test/support/postgres.ts";

export interface BenchCluster {
  /** The store's URL (for a server the bench starts as a process of its own). */
  dbUrl: string;
  /** Starts one more server on the store. */
  start(): Promise<TestKiln>;
}

/** Runs `body` with a fresh PostgreSQL and `servers` servers started on it; `env` is added to each server's. */
export async function withCluster<T>(servers: number, env: Record<string, string>, body: (started: TestKiln[], cluster: BenchCluster) => Promise<T>): Promise<T> {
  const db = await startPostgres();
  const all: TestKiln[] = [];
  const cluster: BenchCluster = {
    dbUrl: db.url,
    async start() {
      const s = await startTestKiln({ env: { KILN_LOG_LEVEL: "warn", KILN_DATABASE_URL: db.url, KILN_WARM_POOL: "0", ...env }, captureLogs: false });
      all.push(s);
      return s;
    },
  };
  try {
    const started: TestKiln[] = [];
    for (let i = 0; i < servers; i++) started.push(await cluster.start());
    return await body(started, cluster);
  } finally {
    for (const s of all.reverse()) await s.close().catch(() => undefined);
    await db.stop();
  }
}
