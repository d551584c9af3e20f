// MCP `run_command` tool calls (Streamable HTTP at POST /v1/mcp, and stdio through `kiln mcp`) beside the same exec
// over REST (POST /v1/machines/{id}/exec), interleaved round by round in the same run so host load hits all alike.

import { join } from "node:path";
import { request } from "undici";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { median, percentile } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const ROUNDS = 200;
const WARMUP = 20;
const COMMAND = "echo hi";

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const auth = { authorization: `Bearer ${ctx.key}` };
  const created = await request(ctx.kiln.url + "/v1/machines", { method: "POST", headers: { ...auth, "content-type": "application/json" }, body: "{}" });
  const machine = (await created.body.json()) as { id: string };

  const http = new Client({ name: "kiln-bench", version: "1.0.0" });
  await http.connect(new StreamableHTTPClientTransport(new URL(`${ctx.kiln.url}/v1/mcp`), { requestInit: { headers: auth } }));
  const stdio = new Client({ name: "kiln-bench-stdio", version: "1.0.0" });
  await stdio.connect(new StdioClientTransport({ command: join(import.meta.dirname, "..", "bin", "kiln"), args: ["mcp"], env: { PATH: process.env.PATH ?? "", KILN_URL: ctx.kiln.url, KILN_API_KEY: ctx.key } }));

  const rest = async () => {
    const res = await request(`${ctx.kiln.url}/v1/machines/${machine.id}/exec`, { method: "POST", headers: { ...auth, "content-type": "application/json" }, body: JSON.stringify({ cmd: COMMAND }) });
    const body = (await res.body.json()) as { stdout: string };
    if (body.stdout !== "hi\n") throw new Error(`REST exec answered ${JSON.stringify(body)}`);
  };
  const tool = (client: Client) => async () => {
    const r = (await client.callTool({ name: "run_command", arguments: { machine_id: machine.id, command: COMMAND } })) as { structuredContent?: { stdout?: string } };
    if (r.structuredContent?.stdout !== "hi\n") throw new Error(`run_command answered ${JSON.stringify(r)}`);
  };
  const ways = { rest, http: tool(http), stdio: tool(stdio) };
  const times: Record<keyof typeof ways, number[]> = { rest: [], http: [], stdio: [] };
  try {
    for (let i = 0; i < ROUNDS + WARMUP; i++) {
      for (const [name, fn] of Object.entries(ways) as [keyof typeof ways, () => Promise<void>][]) {
        const t0 = performance.now();
        await fn();
        if (i >= WARMUP) times[name].push(performance.now() - t0);
      }
    }
  } finally {
    await http.close();
    await stdio.close();
    await request(`${ctx.kiln.url}/v1/machines/${machine.id}`, { method: "DELETE", headers: auth }).then((r) => r.body.dump());
  }
  const baseline = { name: "POST /v1/machines/{id}/exec (REST)", median: median(times.rest), p99: percentile(times.rest, 99) };
  return [
    {
      name: "MCP run_command over Streamable HTTP (POST /v1/mcp)",
      unit: "ms",
      better: "lower",
      median: median(times.http),
      p99: percentile(times.http, 99),
      baseline,
      goal: "≤ 1.5× REST exec",
      note: "one stateless McpServer per POST; run_command calls the exec service directly (no second Fastify request)",
    },
    {
      name: "MCP run_command over stdio (kiln mcp)",
      unit: "ms",
      better: "lower",
      median: median(times.stdio),
      p99: percentile(times.stdio, 99),
      baseline,
      goal: "≤ 1.5× REST exec",
      note: "JSON-RPC over the child's pipes, then HTTP to KILN_URL",
    },
  ];
}
