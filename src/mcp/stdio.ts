// `kiln mcp`: the same tools over stdio for desktop agent apps, calling the Kiln server at KILN_URL with
// KILN_API_KEY. stdout carries only MCP messages; anything said to a person goes to stderr.

import { StdioServerTransport } from "@modelcontextprotocol/sdk/server/stdio.js";
import { httpCaller } from "./caller.ts";
import { createMcpServer } from "./server.ts";

export async function serveStdio(opts: { baseUrl: string; key: string }): Promise<void> {
  const server = createMcpServer({ call: httpCaller(opts.baseUrl, opts.key), baseUrl: opts.baseUrl });
  const transport = new StdioServerTransport();
  const closed = new Promise<void>((resolve) => (transport.onclose = resolve));
  await server.connect(transport);
  // The client ends the session by closing our stdin.
  process.stdin.once("end", () => void server.close());
  await closed;
}
