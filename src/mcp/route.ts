// POST /v1/mcp: MCP over Streamable HTTP, stateless (each POST carries its own JSON-RPC messages and gets its own
// McpServer), authenticated by the route's `key` like every /v1 route; tools act with the key the request carried.
// An answer ready within QUICK_ANSWER_MS goes back as one JSON body (cheapest for both sides: no stream framing, no
// SSE parser in the client); a slower one streams as SSE with keep-alive comments from then on, so a long
// run_command is never cut by a client's idle timeout. MCP lets the server choose either for every POST.

import { Readable } from "node:stream";
import type { ReadableStream as WebReadableStream, ReadableStreamDefaultReader, ReadableStreamReadResult } from "node:stream/web";
import { Type } from "typebox";
import { WebStandardStreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/webStandardStreamableHttp.js";
import type { App } from "../api/app-type.ts";
import { presentedKey } from "../api/auth.ts";
import { errors } from "../api/schemas.ts";
import { injectCaller } from "./caller.ts";
import { createMcpServer } from "./server.ts";

export const MCP_PATH = "/v1/mcp";

/** How long an answer may take and still go back as plain JSON; past it the client gets SSE headers at once. */
export const QUICK_ANSWER_MS = 1000;

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
      if (!String(answer.headers.get("content-type")).startsWith("text/event-stream")) return reply.send(Readable.fromWeb(answer.body as WebReadableStream<Uint8Array>));
      const reader = answer.body.getReader();
      const quick = await readQuickly(reader, QUICK_ANSWER_MS);
      const single = quick.done ? onlyMessage(quick.chunks) : undefined;
      if (single !== undefined) return reply.header("content-type", "application/json").removeHeader("connection").send(single);
      // Slow, or more than one message (notifications before the result): SSE, what was read first, then the rest.
      return reply.send(Readable.from(rest(quick.chunks, quick.done ? undefined : reader)));
    },
  );
}

/** Reads the answer's stream until it ends or `ms` pass, whichever is first. */
async function readQuickly(reader: ReadableStreamDefaultReader<Uint8Array>, ms: number): Promise<{ chunks: Uint8Array[]; done: boolean }> {
  const chunks: Uint8Array[] = [];
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<"late">((resolve) => (timer = setTimeout(() => resolve("late"), ms)));
  try {
    // A read still pending at the deadline is not lost: rest() awaits it first.
    let pending = reader.read();
    for (;;) {
      const got = await Promise.race([pending, late]);
      if (got === "late") {
        pendingReads.set(reader, pending);
        return { chunks, done: false };
      }
      if (got.done) return { chunks, done: true };
      chunks.push(got.value);
      pending = reader.read();
    }
  } finally {
    clearTimeout(timer);
  }
}

const pendingReads = new WeakMap<ReadableStreamDefaultReader<Uint8Array>, Promise<ReadableStreamReadResult<Uint8Array>>>();

async function* rest(first: Uint8Array[], reader: ReadableStreamDefaultReader<Uint8Array> | undefined): AsyncGenerator<Uint8Array> {
  yield* first;
  if (!reader) return;
  let pending = pendingReads.get(reader) ?? reader.read();
  try {
    for (;;) {
      const got = await pending;
      if (got.done) return;
      yield got.value;
      pending = reader.read();
    }
  } finally {
    // The client went away mid-stream: let the transport know.
    void reader.cancel().catch(() => undefined);
  }
}

/** The JSON-RPC message of an SSE answer holding exactly one `message` event (and maybe keep-alive comments). */
function onlyMessage(chunks: Uint8Array[]): string | undefined {
  const events = Buffer.concat(chunks).toString("utf8").split(/\r?\n\r?\n/).filter((e) => e.trim() !== "" && !e.startsWith(":"));
  if (events.length !== 1) return undefined;
  const lines = events[0]!.split(/\r?\n/);
  if (lines.some((l) => l.startsWith("event:") && l.slice(6).trim() !== "message")) return undefined;
  const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
  return data.length > 0 ? data.join("\n") : undefined;
}
