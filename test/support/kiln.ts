// A real Kiln server for a test: its own data dir (SQLite, or PostgreSQL when asked), the shared base-template
// cache, a known API key, listening on a free loopback port; plus a small JSON client for it.

import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Writable } from "node:stream";
import { request } from "undici";
import { loadConfig } from "../../src/config.ts";
import { startKiln } from "../../src/app.ts";
import type { Kiln } from "../../src/app.ts";
import { bufferedDestination, createLogger } from "../../src/log.ts";
import { TEST_CACHE_DIR, TEST_RUNTIME } from "./paths.ts";

export const TEST_KEY = "kiln_test_0123456789abcdefghijklmnopqrstuv";

export interface TestKiln {
  kiln: Kiln;
  url: string;
  dataDir: string;
  /** Every log line the server wrote, for assertions about what is (not) logged. */
  logs: string[];
  /**
   * One request. A machine's DELETE answers before its remains are removed (teardown.ts): unless `settle` is false,
   * the call then also waits (bounded) for that cleanup, so a test's look at the host sees it done.
   */
  call(method: string, path: string, opts?: { body?: unknown; key?: string | null; headers?: Record<string, string>; raw?: string | Buffer; settle?: boolean }): Promise<{ status: number; body: any; headers: Record<string, string | string[] | undefined>; text: string }>;
  /** Stops the server, leaving machines and data dir alone (to test restart and adoption). */
  stop(): Promise<void>;
  /** Stops the server, destroys its machines and removes its data dir. */
  close(): Promise<void>;
}

export async function startTestKiln(opts: { dataDir?: string; env?: Record<string, string>; waitForBase?: boolean; captureLogs?: boolean } = {}): Promise<TestKiln> {
  const dataDir = opts.dataDir ?? (await mkdtemp(join(tmpdir(), "kiln-test-")));
  const config = loadConfig({ KILN_DATA_DIR: dataDir, KILN_CACHE_DIR: TEST_CACHE_DIR, KILN_PORT: "0", KILN_API_KEY: TEST_KEY, KILN_LOG_LEVEL: "debug", KILN_OCI_RUNTIME: TEST_RUNTIME, ...opts.env });
  const logs: string[] = [];
  const destination = new Writable({
    write(chunk, _enc, cb) {
      const line = String(chunk);
      logs.push(line);
      // A server's unexpected failures (error and fatal) reach the test output, so a 500 in a CI run says why.
      if (/"level":(5|6)0\b/.test(line)) process.stderr.write(`[kiln server error] ${line}`);
      cb();
    },
  });
  // Benchmarks log as a real server does (info, to a file descriptor), not into an array at debug level.
  const log = opts.captureLogs === false ? createLogger({ level: config.logLevel, destination: bufferedDestination("/dev/null") }) : createLogger({ level: "debug", destination });
  const kiln = await startKiln(config, { log });
  if (opts.waitForBase !== false) await kiln.baseReady;
  const url = kiln.url;
  let stopped = false;

  async function call(method: string, path: string, o: { body?: unknown; key?: string | null; headers?: Record<string, string>; raw?: string | Buffer; settle?: boolean } = {}) {
    const headers: Record<string, string> = { ...o.headers };
    if (o.key !== null) headers.authorization = `Bearer ${o.key ?? TEST_KEY}`;
    let body: string | Buffer | undefined = o.raw;
    if (o.body !== undefined) {
      body = JSON.stringify(o.body);
      headers["content-type"] ??= "application/json";
    }
    const res = await request(url + path, { method: method as "GET", headers, body });
    const text = await res.body.text();
    let parsed: unknown = undefined;
    try {
      parsed = text ? JSON.parse(text) : undefined;
    } catch {
      parsed = undefined;
    }
    if (method === "DELETE" && /^\/v1\/machines\/[^/?]+$/.test(path) && o.settle !== false) await kiln.services.machines.cleanupsSettled(60_000);
    return { status: res.statusCode, body: parsed as any, headers: res.headers as Record<string, string | string[] | undefined>, text };
  }

  async function stop() {
    if (stopped) return;
    stopped = true;
    await kiln.close();
  }

  async function close() {
    if (!stopped) {
      const live = await kiln.services.machines.list({ limit: 100 });
      for (const m of live.machines) await kiln.services.machines.destroy(m.id).catch(() => undefined);
      // Volumes are mounted loop images: removing the data dir under them would leak the mount and its loop device.
      const volumes = await kiln.services.volumes.list({ limit: 100 });
      for (const v of volumes.volumes) await kiln.services.volumes.remove(v.id).catch(() => undefined);
      await stop();
    }
    await rm(dataDir, { recursive: true, force: true });
  }

  return { kiln, url, dataDir, logs, call, stop, close };
}
