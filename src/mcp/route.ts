// POST /v1/mcp: MCP over Streamable HTTP, stateless (each POST carries its own JSON-RPC messages and gets its own
// McpServer), authenticated by the route's `key` like every /v1 route; tools act with the key the request carried.
// Answers stream as SSE (with keep-alive comments), so a long run_command is never cut by a client's idle timeout.

import { Readable } from "node:stream";
import type { ReadableStream as WebReadableStream } from "node:stream/web";
import { Type } from "typebox";
import { WebStandardStreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/webStandardStreamableHttp.js";
import type { App } from "../api/app-type.ts";
import { presentedKey } from "../api/auth.ts";
import { errors } from "../api/schemas.ts";
import { injectCaller } from "./caller.ts";
import { createMcpServer } from "./server.ts";

export const MCP_PATH = "/v1/mcp";

export async function mcpRoutes(app: App) {
  app.post(
    MCP_PATH,
    {
      config: { auth: "key" },
      schema: {
        tags: ["MCP"],
        summary: "Model Context Protocol (Streamable HTTP, stateless): JSON-RPC messages in, JSON or SSE out; tools per docs/mcp.md",
        description: "Send `Accept: application/json, text/event-stream`. GET and DELETE are not offered (no sessions): clients fall back to POST only.",
        body: Type.Unknown({ description: "A JSON-RPC message or batch (MCP 2025-06-18)" }),
        response: { ...errors() },
      },
    },
    async (req, reply) => {
      const host = req.headers.host;
      const server = createMcpServer({
        // The auth hook accepted this key for this request; the tools' calls are checked again, route by route.
        call: injectCaller(app, { key: presentedKey(req)!, host }),
        baseUrl: `${req.protocol}://${host ?? "localhost"}`,
      });
      const transport = new WebStandardStreamableHTTPServerTransport({ sessionIdGenerator: undefined });
      await server.connect(transport);
      const headers = new Headers();
      for (const [k, v] of Object.entries(req.headers)) if (typeof v === "string") headers.set(k, v);
      const answer = await transport.handleRequest(new Request(`http://localhost${MCP_PATH}`, { method: "POST", headers }), { parsedBody: req.body });
      // The server lives as long as its answer: closed when the response ends, or when the client goes away.
      reply.raw.once("close", () => void server.close().catch(() => undefined));
      reply.code(answer.status);
      answer.headers.forEach((value, name) => void reply.header(name, value));
      if (!answer.body) return reply.send();
      return reply.send(Readable.fromWeb(answer.body as WebReadableStream<Uint8Array>));
    },
  );
}
