// The guest-agent clients of the machines this server runs: one per running machine, replaced when the machine's
// execution changes (create, resume, adoption) and dropped when it stops.

import type { LiveMachine } from "../runtime/driver.ts";
import { createAgentClient } from "../runtime/agent-client.ts";
import type { AgentClient } from "../runtime/agent-client.ts";

export class AgentRegistry {
  readonly #agents = new Map<string, AgentClient>();

  /** A fresh client for a live machine, closing the one it had. */
  attach(live: LiveMachine): AgentClient {
    this.#agents.get(live.id)?.close();
    const client = createAgentClient(live.agentSocket);
    this.#agents.set(live.id, client);
    return client;
  }

  /** Puts back a client for a socket (a hibernate that failed keeps the machine running). */
  reattach(id: string, socketPath: string): void {
    this.#agents.set(id, createAgentClient(socketPath));
  }

  get(id: string): AgentClient | undefined {
    return this.#agents.get(id);
  }

  /** Drops a machine's agent client without waiting: execs in flight answer 409 and the agent ends their commands. */
  async detach(id: string): Promise<void> {
    const client = this.#agents.get(id);
    this.#agents.delete(id);
    await client?.destroy().catch(() => undefined);
  }

  /**
   * Drops a machine's agent client, its connections torn down now without waiting for their close (a destroy kills
   * the other end right after; under gVisor the close took ≈ 130 ms to be confirmed).
   */
  drop(id: string): void {
    const client = this.#agents.get(id);
    this.#agents.delete(id);
    client?.destroy().catch(() => undefined);
  }

  ids(): string[] {
    return [...this.#agents.keys()];
  }
}
