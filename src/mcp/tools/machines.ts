// Machine tools: create (template, timeout, limits), list, destroy — POST/GET/DELETE /v1/machines.

import { z } from "zod";
import type { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { callJson } from "../caller.ts";
import { guarded, seg, textResult } from "../result.ts";
import type { ToolContext } from "../result.ts";

export const MachineId = z.string().regex(/^[A-Za-z0-9_-]{1,64}$/, "a machine id such as mch_…").describe("The machine's id (mch_…), from create_machine or list_machines");

export interface Machine {
  id: string;
  name: string | null;
  status: string;
  template_id: string;
  created_at: string;
  expires_at: string | null;
  cwd: string | null;
  user: string;
}

function describe(m: Machine): string {
  return `${m.id}  ${m.status}  template ${m.template_id}${m.name ? `  name ${m.name}` : ""}  created ${m.created_at}${m.expires_at ? `  expires ${m.expires_at}` : ""}`;
}

// Made once: a zod schema is compiled on first use, and every request builds a server of these tools.
const createMachineInput = z.object({
  template: z.string().min(1).max(256).optional().describe("Template ref, e.g. `local/python` or an artifact id (default: the base Debian template, `local/base`)"),
  snapshot: z.string().regex(/^[A-Za-z0-9_-]{1,64}$/).optional().describe("Start from this snapshot (snp_…, from snapshot_machine) instead of a template: its files, template and size"),
  timeout_s: z.number().int().min(1).optional().describe("Seconds until the machine is destroyed (default 300)"),
  vcpus: z.number().int().min(1).optional().describe("vCPUs (default 1)"),
  memory_mb: z.number().int().min(1).optional().describe("Memory limit in MiB (default 1024)"),
  disk_mb: z.number().int().min(1).optional().describe("Size of the machine's writable disk in MiB (the server's default when omitted)"),
  internet: z.boolean().optional().describe("Outbound internet access (default true)"),
  allow_out: z
    .array(z.string().min(1).max(64))
    .max(64)
    .optional()
    .describe("Destinations (CIDRs) opened beyond the default, which refuses the host, private and link-local ranges; opening those takes the operator's key"),
  envs: z.record(z.string(), z.string()).optional().describe("Environment variables for every command in the machine"),
  name: z.string().min(1).max(128).optional(),
  metadata: z.record(z.string(), z.string()).optional().describe("Free-form labels kept with the machine"),
});

const listMachinesInput = z.object({
  limit: z.number().int().min(1).max(100).optional().describe("At most this many (default 50)"),
  cursor: z.string().max(512).optional().describe("next_cursor of the previous page"),
});

const destroyMachineInput = z.object({ machine_id: MachineId });

export function machineTools(server: McpServer, ctx: ToolContext) {
  server.registerTool(
    "create_machine",
    {
      title: "Create a machine",
      description:
        "Create an isolated Linux machine (a container with its own network) from a template and start it. Returns its id, which every other tool takes. " +
        "The machine is destroyed when its timeout runs out (default 300 s; destroy_machine ends it sooner). Files live under /workspace; commands run as `user` unless told otherwise.",
      inputSchema: createMachineInput,
      annotations: { openWorldHint: false },
    },
    guarded(ctx, async ({ call }, args) => {
      // Through the API, never directly: the route decides who may open which ranges (the operator's key).
      const { allow_out, ...rest } = args;
      const body = { ...withoutUndefined(rest), ...(allow_out ? { network: { allow_out } } : {}) };
      const m = await callJson<Machine>(call, "POST", "/v1/machines", { json: body });
      return textResult(`Created machine ${m.id} (${m.status}); working directory ${m.cwd ?? "/workspace"}, user ${m.user}.\n${describe(m)}`, { machine: m });
    }),
  );

  server.registerTool(
    "list_machines",
    {
      title: "List machines",
      description: "List the machines this API key can use (newest first), with status, template and age. Pass `cursor` from a previous answer for the next page.",
      inputSchema: listMachinesInput,
      annotations: { readOnlyHint: true, openWorldHint: false },
    },
    guarded(ctx, async ({ call }, args) => {
      const page = await callJson<{ machines: Machine[]; next_cursor: string | null }>(call, "GET", "/v1/machines", { query: { limit: args.limit, cursor: args.cursor } });
      const lines = page.machines.map(describe);
      const text = lines.length === 0 ? "No machines. create_machine makes one." : lines.join("\n") + (page.next_cursor ? `\n(more: call again with cursor ${page.next_cursor})` : "");
      return textResult(text, page);
    }),
  );

  server.registerTool(
    "destroy_machine",
    {
      title: "Destroy a machine",
      description: "Stop a machine and delete it with everything in it (its files are gone for good).",
      inputSchema: destroyMachineInput,
      annotations: { destructiveHint: true, idempotentHint: true, openWorldHint: false },
    },
    guarded(ctx, async ({ call }, args) => {
      await callJson(call, "DELETE", `/v1/machines/${seg(args.machine_id)}`);
      return textResult(`Destroyed machine ${args.machine_id}.`);
    }),
  );
}

export function withoutUndefined<T extends Record<string, unknown>>(o: T): Partial<T> {
  return Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined)) as Partial<T>;
}
