// A Kiln server as its own process (`node src/cli/main.ts serve`), for tests that kill it or run two side by side.

import { spawn } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { join } from "node:path";
import { request } from "undici";
import { TEST_KEY } from "../support/kiln.ts";
import { TEST_CACHE_DIR, TEST_RUNTIME } from "../support/paths.ts";
import { freePort } from "../support/net.ts";

const MAIN = join(import.meta.dirname, "..", "..", "src", "cli", "main.ts");

export interface ServerProcess {
  url: string;
  child: ChildProcess;
  /** Everything the process wrote, stdout and stderr. */
  output: () => string;
  call(method: string, path: string, body?: unknown): Promise<{ status: number; body: any }>;
  /** Resolves with the exit once the process has ended. */
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  stop(): Promise<void>;
}

export async function startServerProcess(dataDir: string, env: Record<string, string> = {}): Promise<ServerProcess> {
  const port = await freePort();
  const child = spawn(process.execPath, [MAIN, "serve"], {
    env: {
      ...process.env,
      KILN_DATA_DIR: dataDir,
      KILN_CACHE_DIR: TEST_CACHE_DIR,
      KILN_API_KEY: TEST_KEY,
      KILN_PORT: String(port),
      KILN_WARM_POOL: "0",
      KILN_OCI_RUNTIME: TEST_RUNTIME,
      KILN_LOG_LEVEL: "debug",
      ...env,
    },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let out = "";
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => child.on("exit", (code, signal) => resolve({ code, signal })));
  const serving = new Promise<void>((resolve, reject) => {
    const onData = (chunk: Buffer) => {
      out += chunk.toString();
      if (out.includes('"kiln is serving"')) resolve();
    };
    child.stdout!.on("data", onData);
    child.stderr!.on("data", onData);
    void exited.then(({ code, signal }) => reject(new Error(`the server exited (${code ?? signal}) before serving:\n${out.slice(-3000)}`)));
  });
  const url = `http://127.0.0.1:${port}`;
  const server: ServerProcess = {
    url,
    child,
    output: () => out,
    exited,
    async call(method, path, body) {
      const res = await request(url + path, {
        method: method as "GET",
        headers: { authorization: `Bearer ${TEST_KEY}`, ...(body === undefined ? {} : { "content-type": "application/json" }) },
        body: body === undefined ? undefined : JSON.stringify(body),
      });
      const text = await res.body.text();
      return { status: res.statusCode, body: text ? JSON.parse(text) : undefined };
    },
    async stop() {
      if (child.exitCode !== null || child.signalCode !== null) return;
      child.kill("SIGTERM");
      const timer = setTimeout(() => child.kill("SIGKILL"), 20_000);
      await exited;
      clearTimeout(timer);
    },
  };
  await serving;
  return server;
}

/** Creates a machine, waiting out the moment after start when the base template is still being registered. */
export async function createMachine(server: ServerProcess): Promise<string> {
  for (let i = 0; ; i++) {
    const res = await server.call("POST", "/v1/machines", {});
    if (res.status === 201) return res.body.id as string;
    if (res.status !== 503 || i > 100) throw new Error(`machine create answered ${res.status}: ${JSON.stringify(res.body)}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}
