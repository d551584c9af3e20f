// Snapshot tools: snapshot a machine, fork it into new machines, list and delete snapshots — the routes of
// docs/snapshots.md (POST /v1/machines/{id}/snapshots, POST …/fork, GET/DELETE /v1/snapshots). A machine is made
// from a snapshot with create_machine's `snapshot` argument.

import { z } from "zod";
import type { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { callJson } from "../caller.ts";
import { guarded, seg, textResult } from "../result.ts";
import type { ToolContext } from "../result.ts";
import { MachineId, withoutUndefined } from "./machines.ts";
import type { Machine } from "./machines.ts";

export const SnapshotId = z.string().regex(/^[A-Za-z0-9_-]{1,64}$/, "a snapshot id such as snp_…").describe("The snapshot's id (snp_…), from snapshot_machine or list_snapshots");

interface Snapshot {
  id: string;
  machine_id: string;
  template_id: string;
  name: string | null;
  memory: boolean;
  size_bytes: number;
  status: string;
  created_at: string;
}

function describe(s: Snapshot): string {
  return `${s.id}  ${s.status}  of ${s.machine_id}${s.name ? `  name ${s.name}` : ""}${s.memory ? "  with memory" : ""}  ${(s.size_bytes / 1048576).toFixed(1)} MiB  taken ${s.created_at}`;
}

/** Forks one call may ask for; the route allows up to 32, an agent rarely wants more than a handful. */
const FORK_MAX = 32;

// Made once: a zod schema is compiled on first use, and every request builds a server of these tools.
const snapshotMachineInput = z.object({
  machine_id: MachineId,
  name: z.string().min(1).max(128).optional().describe("A name to find it by"),
  memory: z.boolean().optional().describe("Save the running processes too (gVisor machines only; default false: the disk alone)"),
  metadata: z.record(z.string(), z.string()).optional().describe("Free-form labels kept with the snapshot"),
});

const forkMachineInput = z.object({
  machine_id: MachineId,
  count: z.number().int().min(1).max(FORK_MAX).optional().describe(`How many new machines (default 1, at most ${FORK_MAX})`),
  timeout_s: z.number().int().min(1).optional().describe("Seconds until each new machine is destroyed (default: the server's)"),
  memory: z.boolean().optional().describe("The new machines continue the parent's running processes (gVisor only; default false: same disk, fresh boot)"),
  metadata: z.record(z.string(), z.string()).optional().describe("Labels for the new machines"),
});

const listSnapshotsInput = z.object({
  machine_id: MachineId.optional().describe("Only the snapshots of this machine"),
  limit: z.number().int().min(1).max(100).optional().describe("At most this many (default 50)"),
  cursor: z.string().max(512).optional().describe("next_cursor of the previous page"),
});

const deleteSnapshotInput = z.object({ snapshot_id: SnapshotId });

export function snapshotTools(server: McpServer, ctx: ToolContext) {
  server.registerTool(
    "snapshot_machine",
    {
      title: "Snapshot a machine",
      description:
        "Save a machine's disk as of now (every file, installed packages included) as a snapshot; the machine goes on running. " +
        "Make new machines from it later with create_machine's `snapshot` argument, e.g. to try something risky and come back.",
      inputSchema: snapshotMachineInput,
      annotations: { openWorldHint: false },
    },
    guarded(ctx, async ({ call }, args) => {
      const { machine_id, ...rest } = args;
      const s = await callJson<Snapshot>(call, "POST", `/v1/machines/${seg(machine_id)}/snapshots`, { json: withoutUndefined(rest) });
      return textResult(`Took snapshot ${s.id} of ${machine_id} (${s.status}).\n${describe(s)}`, { snapshot: s });
    }),
  );

  server.registerTool(
    "fork_machine",
    {
      title: "Fork a machine",
      description:
        "Copy a running machine into `count` new machines in one call: each starts with the parent's files as of now and is independent of it " +
        "(the parent goes on). Use it to try several approaches in parallel. Returns the new machines' ids; destroy them with destroy_machine.",
      inputSchema: forkMachineInput,
      annotations: { openWorldHint: false },
    },
    guarded(ctx, async ({ call }, args) => {
      const { machine_id, ...rest } = args;
      const { machines } = await callJson<{ machines: Machine[] }>(call, "POST", `/v1/machines/${seg(machine_id)}/fork`, { json: withoutUndefined(rest) });
      const ids = machines.map((m) => m.id);
      return textResult(`Forked ${machine_id} into ${ids.length} machine${ids.length === 1 ? "" : "s"}: ${ids.join(", ")}`, { machines });
    }),
  );

  server.registerTool(
    "list_snapshots",
    {
      title: "List snapshots",
      description: "List snapshots this API key can use (newest first), optionally only one machine's. Pass `cursor` from a previous answer for the next page.",
      inputSchema: listSnapshotsInput,
      annotations: { readOnlyHint: true, openWorldHint: false },
    },
    guarded(ctx, async ({ call }, args) => {
      const page = await callJson<{ snapshots: Snapshot[]; next_cursor: string | null }>(call, "GET", "/v1/snapshots", { query: withoutUndefined(args) });
      const lines = page.snapshots.map(describe);
      const text = lines.length === 0 ? "No snapshots. snapshot_machine takes one." : lines.join("\n") + (page.next_cursor ? `\n(more: call again with cursor ${page.next_cursor})` : "");
      return textResult(text, page);
    }),
  );

  server.registerTool(
    "delete_snapshot",
    {
      title: "Delete a snapshot",
      description: "Delete a snapshot for good. Machines already made from it keep their files.",
      inputSchema: deleteSnapshotInput,
      annotations: { destructiveHint: true, idempotentHint: true, openWorldHint: false },
    },
    guarded(ctx, async ({ call }, args) => {
      await callJson(call, "DELETE", `/v1/snapshots/${seg(args.snapshot_id)}`);
      return textResult(`Deleted snapshot ${args.snapshot_id}.`);
    }),
  );
}
