// Kiln as an MCP server: the tools an agent gets, on one McpServer per connection (stdio) or per request (HTTP).
// Every tool calls Kiln's own HTTP API with the client's key (caller.ts).

import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { AjvJsonSchemaValidator } from "@modelcontextprotocol/sdk/validation/ajv";
import type { ToolContext } from "./result.ts";
import { machineTools } from "./tools/machines.ts";
import { commandTools } from "./tools/commands.ts";
import { fileTools } from "./tools/files.ts";
import { codeTools } from "./tools/code.ts";
import { portTools } from "./tools/ports.ts";
import { snapshotTools } from "./tools/snapshots.ts";

export const MCP_SERVER_INFO = { name: "kiln", title: "Kiln machines", version: "0.1.0" } as const;

const INSTRUCTIONS =
  "Kiln gives you isolated Linux machines. Make one with create_machine, then use its id with run_command, read_file, " +
  "write_file, list_files and run_code (Python or JavaScript kernels whose state persists between calls). " +
  "snapshot_machine saves a machine's files to come back to (create_machine with `snapshot`); fork_machine copies a machine into new ones. " +
  "Machines are destroyed when their timeout runs out; call destroy_machine when you are done.";

/** One for the process: each McpServer would otherwise make its own Ajv (≈ a millisecond of schema compiling per POST). */
const jsonSchemaValidator = new AjvJsonSchemaValidator();

export function createMcpServer(ctx: ToolContext): McpServer {
  const server = new McpServer(MCP_SERVER_INFO, { instructions: INSTRUCTIONS, capabilities: { tools: { listChanged: false } }, jsonSchemaValidator });
  machineTools(server, ctx);
  commandTools(server, ctx);
  fileTools(server, ctx);
  codeTools(server, ctx);
  portTools(server, ctx);
  snapshotTools(server, ctx);
  return server;
}
