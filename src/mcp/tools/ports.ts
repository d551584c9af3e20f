// get_port_url: how to reach a server listening on a machine's port. Kiln routes `<port>-<machine id>.<domain>` to that
// port (the E2B-compatible port proxy, docs/e2b.md) for requests carrying the machine's access token, which
// GET /sandboxes/{id} issues to this API key; this tool hands both out.

import { z } from "zod";
import type { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { callJson } from "../caller.ts";
import { guarded, seg, textResult } from "../result.ts";
import type { ToolContext } from "../result.ts";
import { MachineId } from "./machines.ts";

/** The header the port proxy takes the machine's access token in. */
const TOKEN_HEADER = "e2b-traffic-access-token";

// Made once: a zod schema is compiled on first use, and every request builds a server of these tools.
const getPortUrlInput = z.object({ machine_id: MachineId, port: z.number().int().min(1).max(65535).describe("The port the server listens on inside the machine") });

export function portTools(server: McpServer, ctx: ToolContext) {
  server.registerTool(
    "get_port_url",
    {
      title: "Get a port's URL",
      description:
        "Get the URL that reaches a server listening on a port inside a machine (HTTP and WebSocket), and the header every request to it must carry. " +
        "Start the server first (e.g. run_command with `nohup python3 -m http.server 8000 >/tmp/http.log 2>&1 &`); it must listen on 0.0.0.0 or the machine's address.",
      inputSchema: getPortUrlInput,
      annotations: { readOnlyHint: true, openWorldHint: false },
    },
    guarded(ctx, async ({ call, baseUrl }, args) => {
      const sandbox = await callJson<{ envdAccessToken: string; domain: string }>(call, "GET", `/sandboxes/${seg(args.machine_id)}`);
      const base = new URL(baseUrl);
      const host = `${args.port}-${args.machine_id}.${sandbox.domain}`;
      const url = `${base.protocol}//${host}/`;
      const headers = { [TOKEN_HEADER]: sandbox.envdAccessToken };
      // Without wildcard DNS for the domain, the same request reaches Kiln's own address with the Host header set.
      const curl = `curl -H 'Host: ${host}' -H '${TOKEN_HEADER}: ${sandbox.envdAccessToken}' ${base.origin}/`;
      return textResult(
        `URL: ${url}\nEvery request needs the header ${TOKEN_HEADER}: ${sandbox.envdAccessToken}\n` +
          `Where ${sandbox.domain} has no wildcard DNS, send the request to Kiln's own address with that Host:\n  ${curl}`,
        { url, headers, host, kiln_url: base.origin },
      );
    }),
  );
}
