// Runs the guest agent for real on the host (from source or from a bundle) on a unix socket in a temp dir,
// and drives it the way the control plane does: through agent-client and its stream socket.

import { spawn } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { WebSocket } from "ws";
import { createAgentClient } from "../../src/runtime/agent-client.ts";
import type { AgentClient } from "../../src/runtime/agent-client.ts";
import { collectFrames } from "../support/frames.ts";

export interface TestAgent {
  dir: string;
  socket: string;
  client: AgentClient;
  child: ChildProcess;
  stop(): Promise<void>;
}

const SOURCE_ENTRY = join(import.meta.dirname, "../../src/agent/main.ts");

export async function startAgent(opts: { entry?: string; env?: Record<string, string> } = {}): Promise<TestAgent> {
  const dir = await mkdtemp(join(tmpdir(), "kiln-agent-"));
  const socket = join(dir, "agent.sock");
  const child = spawn(process.execPath, [opts.entry ?? SOURCE_ENTRY, "--socket", socket], {
    stdio: ["ignore", "inherit", "inherit"],
    env: { ...process.env, ...opts.env },
  });
  const client = createAgentClient(socket);
  const deadline = Date.now() + 10_000;
  for (;;) {
    try {
      await client.health();
      break;
    } catch (err) {
      if (Date.now() > deadline || child.exitCode !== null) throw new Error(`the agent did not come up: ${(err as Error).message}`);
      await new Promise((r) => setTimeout(r, 25));
    }
  }
  return {
    dir,
    socket,
    client,
    child,
    async stop() {
      await client.close();
      if (child.exitCode === null) {
        const exited = new Promise((r) => child.once("exit", r));
        child.kill("SIGTERM");
        await exited;
      }
      await rm(dir, { recursive: true, force: true });
    },
  };
}

/** A stream-socket test client: collects frames, waits for the next one matching a predicate. */
export async function openStream(agent: TestAgent) {
  const ws: WebSocket = agent.client.openStream();
  const reader = collectFrames(ws);
  await new Promise<void>((resolve, reject) => {
    ws.once("open", () => resolve());
    ws.once("error", reject);
  });
  const client = {
    ws,
    ...reader,
    close: () =>
      new Promise<void>((resolve) => {
        if (ws.readyState === ws.CLOSED) return resolve();
        ws.once("close", () => resolve());
        ws.close();
      }),
  };
  return client;
}

export type StreamClient = Awaited<ReturnType<typeof openStream>>;

export const ALL_BYTES = Buffer.from(Array.from({ length: 256 }, (_, i) => i));

export const text = (b64: string) => Buffer.from(b64, "base64").toString("utf8");
