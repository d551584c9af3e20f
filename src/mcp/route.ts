// POST /v1/mcp: MCP over Streamable HTTP, stateless (each POST carries its own JSON-RPC messages and gets its own
// McpServer), authenticated by the route's `key` like every /v1 route; tools act with the key the request carried.
// The SDK's transport runs in JSON response mode (`enableJsonResponse`): it hands back the whole answer at once, with
// no stream or SSE framing to build and parse again. An answer ready within QUICK_ANSWER_MS goes back as that JSON
// body; past it the client gets SSE headers and keep-alive comments, then the answer as `message` events, so a long
// run_command is never cut by a client's idle timeout. MCP lets the server choose either for every POST. Kiln's tools
// send no notifications during a call (JSON response mode would have nowhere to put them).

import { PassThrough } from "node:stream";
import { Type } from "typebox";
import { WebStandardStreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/webStandardStreamableHttp.js";
import type { App } from "../api/app-type.ts";
import { presentedKey } from "../api/auth.ts";
import { errors } from "../api/schemas.ts";
import { heldAnswersBudget, injectCaller } from "./caller.ts";
import { directCalls } from "./direct.ts";
import type { DirectDeps } from "./direct.ts";
import { createMcpServer } from "./server.ts";

export const MCP_PATH = "/v1/mcp";

/** How long an answer may take and still go back as plain JSON; past it the client gets SSE headers at once. */
export const QUICK_ANSWER_MS = 1000;
/** How often a slow answer's SSE stream carries a comment, so that no proxy or client idle timeout cuts it. */
export const KEEP_ALIVE_MS = 15_000;

/** The request headers MCP's transport reads (Accept, Content-Type, the protocol version, Host for its checks). */
const MCP_HEADERS = ["accept", "content-type", "mcp-protocol-version", "mcp-session-id", "host", "origin"];
const URL_OF_ROUTE = `http://localhost${MCP_PATH}`;

export async function mcpRoutes(app: App, opts: { direct?: DirectDeps; heldMaxBytes?: number }) {
  const budget = heldAnswersBudget(opts.heldMaxBytes);
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
      // What this request's tools read stays counted against the server's budget until its answer is gone.
      const held = budget.ledger();
      reply.raw.once("close", held.release);
      // The auth hook accepted this key for this request; the tools' calls are checked again, route by route.
      const call = injectCaller(app, { key: presentedKey(req)!, host, take: held.take });
      const server = createMcpServer({
        call,
        baseUrl: `${req.protocol}://${host ?? "localhost"}`,
        direct: opts.direct ? directCalls(opts.direct, { call, requestId: req.id, log: req.log }) : undefined,
      });
      const transport = new WebStandardStreamableHTTPServerTransport({ sessionIdGenerator: undefined, enableJsonResponse: true });
      await server.connect(transport);
      const headers = new Headers();
      for (const name of MCP_HEADERS) {
        const v = req.headers[name];
        if (typeof v === "string") headers.set(name, v);
      }
      // A client that goes away before its answer: the server is closed (its handlers' signals abort). Once the answer
      // is handed over nothing of the server is left open (no stream, no timer) and it is simply dropped: closing it
      // then would only build a "Connection closed" error for nobody, a tenth of a millisecond on every call.
      let answered = false;
      const gone = new Promise<"gone">((resolve) => reply.raw.once("close", () => (resolve("gone"), answered ? undefined : void server.close().catch(() => undefined))));
      const answer = transport.handleRequest(new Request(URL_OF_ROUTE, { method: "POST", headers }), { parsedBody: req.body });
      let timer: NodeJS.Timeout | undefined;
      const late = new Promise<"late">((resolve) => (timer = setTimeout(resolve, QUICK_ANSWER_MS, "late")));
      const first = await Promise.race([answer, late, gone]);
      clearTimeout(timer);
      if (first === "gone") return reply;
      if (first !== "late") {
        answered = true;
        // Quick (or refused by the transport: its JSON-RPC error with its status, or 202 for notifications only).
        reply.code(first.status);
        first.headers.forEach((value, name) => void reply.header(name, value));
        return reply.send(first.body ? await first.text() : undefined);
      }
      // Slow: SSE from now on, keep-alive comments until the answer, then each of its messages as a `message` event.
      const sse = new PassThrough();
      const keepAlive = setInterval(() => sse.write(": keep-alive\n\n"), KEEP_ALIVE_MS);
      sse.once("close", () => clearInterval(keepAlive));
      sse.write(": the answer follows\n\n");
      void Promise.race([answer, gone]).then(
        async (done) => {
          clearInterval(keepAlive);
          if (done === "gone") return void sse.destroy();
          answered = true;
          const body: unknown = done.body ? JSON.parse(await done.text()) : [];
          for (const message of Array.isArray(body) ? body : [body]) sse.write(`event: message\ndata: ${JSON.stringify(message)}\n\n`);
          sse.end();
        },
        (err: unknown) => sse.destroy(err as Error),
      );
      return reply.code(200).header("content-type", "text/event-stream").header("cache-control", "no-cache, no-transform").header("x-accel-buffering", "no").send(sse);
    },
  );
}
