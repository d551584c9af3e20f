// A caller of the guest agent's code execute with envs it refuses (a bad name, over 64 KiB): the refusal is an answer
// (invalid_request) before any 200 head, never a stream cut with no answer; the kernel goes on. The agent runs from
// source on the host (test/agent/support.ts), as the agent tests do.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startAgent } from "../agent/support.ts";
import type { TestAgent } from "../agent/support.ts";

let agent: TestAgent;
before(async () => {
  agent = await startAgent();
});
after(async () => agent?.stop());

test("envs the agent refuses are an invalid_request answer, not a cut stream; the next execute runs", async () => {
  const ctx = await agent.client.codeCreate({ id: "ctx_atk24envs", language: "javascript", cwd: "/tmp", user: "root" });
  const refused: Record<string, string>[] = [{ "BAD-NAME": "x" }, { A: "a".repeat(40_000), B: "b".repeat(40_000) }];
  for (const envs of refused) {
    await assert.rejects(
      agent.client.codeExecute({ code: "1", context_id: ctx.id, envs }),
      (err: { code?: string; message?: string }) => err.code === "invalid_request" || /invalid_request|envs/.test(String(err.message)),
      `refused as a request: ${Object.keys(envs).join(",")}`,
    );
  }
  const body = await agent.client.codeExecute({ code: "6 * 7", context_id: ctx.id });
  let text = "";
  for await (const chunk of body) text += chunk;
  assert.match(text, /"42"/);
  await agent.client.codeDelete(ctx.id);
});
