// `kiln mcp`: Kiln's MCP tools over stdio, for agent apps that start their MCP servers as commands.

import type { Command } from "commander";
import { apiClient } from "./client.ts";

export function mcpCommand(program: Command) {
  program
    .command("mcp")
    .description("Serve Kiln's MCP tools over stdio (for desktop agent apps); talks to KILN_URL with KILN_API_KEY")
    .action(async () => {
      const { baseUrl, key } = apiClient();
      const { serveStdio } = await import("../mcp/stdio.ts");
      await serveStdio({ baseUrl, key });
    });
}
