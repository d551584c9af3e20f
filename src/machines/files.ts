// Files in a running machine: every path resolved by SPEC.md's rule, every user checked against the
// machine's own /etc/passwd, then handed to the guest agent.

import type { Readable } from "node:stream";
import { KilnError } from "../errors.ts";
import type { MachineService } from "./service.ts";
import { machineTarget } from "./target.ts";
import { viaAgent } from "./agent-errors.ts";
import { LIST_DEFAULT_LIMIT } from "../agent/list-pages.ts";
import type { FileInfo } from "../agent/protocol.ts";
import { decodeListCursor, encodeListCursor } from "../store/cursor.ts";

export interface FileService {
  info(id: string, input: { path: string; user?: string }): Promise<FileInfo>;
  read(id: string, input: { path: string; user?: string }): Promise<Readable>;
  write(id: string, input: { path: string; user?: string; mode?: string; metadata?: Record<string, string> }, body: Readable | Buffer): Promise<FileInfo>;
  /**
   * One page of a directory listing: `limit` entries (default LIST_DEFAULT_LIMIT, at most LIST_MAX_LIMIT), the rest
   * through `next_cursor` (null on the last page). The agent never holds a whole directory, nor does this.
   */
  list(id: string, input: { path: string; user?: string; depth?: number; limit?: number; cursor?: string }): Promise<{ entries: FileInfo[]; next_cursor: string | null }>;
  mkdir(id: string, input: { path: string; user?: string; mode?: string }): Promise<FileInfo>;
  remove(id: string, input: { path: string; user?: string; recursive?: boolean }): Promise<void>;
  move(id: string, input: { src: string; dest: string; user?: string }): Promise<FileInfo>;
}

export function createFileService(machines: MachineService): FileService {
  /** Resolves `path` for machine `id` and, when a user is named, checks that user exists (400 otherwise). */
  const target = (id: string, path: string, user: string | undefined) => machineTarget(machines, id, path, user, { refuseEmpty: true });

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
    /**
     * One page of a directory listing: `limit` entries (default LIST_DEFAULT_LIMIT, at most LIST_MAX_LIMIT), the rest
     * through `next_cursor` (null on the last page). The agent never holds a whole directory, nor does this.
     */
    async list(id: string, input: { path: string; user?: string; depth?: number; limit?: number; cursor?: string }): Promise<{ entries: FileInfo[]; next_cursor: string | null }> {
      const t = await target(id, input.path, input.user);
      const listing = { path: t.path, depth: input.depth ?? 1 };
      const after = input.cursor ? decodeListCursor(input.cursor, listing) : undefined;
      const page = await viaAgent(() => t.agent.list(t.path, listing.depth, { limit: input.limit ?? LIST_DEFAULT_LIMIT, after }));
      return { entries: page.entries, next_cursor: page.next_after ? encodeListCursor(listing, page.next_after) : null };
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
