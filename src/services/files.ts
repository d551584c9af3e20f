// Files in a running machine: every path resolved by SPEC.md's rule, every user checked against the
// machine's own /etc/passwd, then handed to the guest agent.

import type { Readable } from "node:stream";
import { KilnError } from "../errors.ts";
import type { MachineService } from "./machines.ts";
import { viaAgent } from "./agent-errors.ts";
import { userOf } from "./exec.ts";
import { needsUserHome, resolveMachinePath } from "./paths.ts";

export function createFileService(machines: MachineService) {
  /** Resolves `path` for machine `id` and, when a user is named, checks that user exists (400 otherwise). */
  async function target(id: string, path: string, user: string | undefined) {
    const { row, agent } = await machines.agentOf(id);
    if (path === "") throw new KilnError("invalid_request", "path must not be empty");
    const info = user !== undefined ? await userOf(agent, user) : undefined;
    const home = needsUserHome(path, row.cwd, user) ? info?.home : undefined;
    let resolved: string;
    try {
      resolved = resolveMachinePath(path, { machineCwd: row.cwd, userHome: home });
    } catch (err) {
      throw new KilnError("invalid_request", (err as Error).message);
    }
    return { agent, path: resolved, user: user ?? row.user };
  }

  return {
    async info(id: string, input: { path: string; user?: string }) {
      const t = await target(id, input.path, input.user);
      return viaAgent(() => t.agent.info(t.path));
    },
    async read(id: string, input: { path: string; user?: string }): Promise<Readable> {
      const t = await target(id, input.path, input.user);
      return viaAgent(() => t.agent.readFile(t.path));
    },
    async write(id: string, input: { path: string; user?: string; mode?: string; metadata?: Record<string, string> }, body: Readable | Buffer) {
      const t = await target(id, input.path, input.user);
      return viaAgent(() => t.agent.writeFile(t.path, body, { mode: input.mode, user: t.user, metadata: input.metadata }));
    },
    async list(id: string, input: { path: string; user?: string; depth?: number }) {
      const t = await target(id, input.path, input.user);
      return viaAgent(() => t.agent.list(t.path, input.depth ?? 1));
    },
    async mkdir(id: string, input: { path: string; user?: string; mode?: string }) {
      const t = await target(id, input.path, input.user);
      return viaAgent(() => t.agent.mkdir(t.path, { mode: input.mode, user: t.user }));
    },
    async remove(id: string, input: { path: string; user?: string; recursive?: boolean }) {
      const t = await target(id, input.path, input.user);
      if (t.path === "/") throw new KilnError("invalid_request", "Refusing to remove /");
      await viaAgent(() => t.agent.remove(t.path, input.recursive ?? false));
    },
    async move(id: string, input: { src: string; dest: string; user?: string }) {
      const src = await target(id, input.src, input.user);
      const dest = await target(id, input.dest, input.user);
      return viaAgent(() => src.agent.move(src.path, dest.path));
    },
  };
}

export type FileService = ReturnType<typeof createFileService>;
