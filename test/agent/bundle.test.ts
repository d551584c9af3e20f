// The bundled agent (one esbuild file plus node-pty's prebuilt binary) runs on its own, away from the project's
// node_modules: exec over HTTP and a PTY over the stream socket prove what a machine will run.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtemp, readdir, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";
import { execFileSync } from "node:child_process";
import { bundleAgent } from "../../src/agent/bundle.ts";
import { startAgent, openStream, text } from "./support.ts";
import type { TestAgent } from "./support.ts";

let outDir: string;
let agent: TestAgent;
before(async () => {
  // Outside the checkout, so nothing can resolve from the project's node_modules.
  outDir = await mkdtemp(join(tmpdir(), "kiln-agent-bundle-"));
  await bundleAgent(outDir);
  agent = await startAgent({ entry: join(outDir, "agent.mjs") });
});
after(async () => {
  await agent?.stop();
  await rm(outDir, { recursive: true, force: true });
});

test("the bundle is one agent.mjs, the kernels' files, node-pty's runtime files and the xattr addon", async () => {
  const files = (await readdir(outDir, { recursive: true, withFileTypes: true })).filter((e) => e.isFile()).map((e) => relative(outDir, join(e.parentPath, e.name)));
  assert.ok(files.includes("agent.mjs"));
  assert.ok(files.includes("node_modules/@lydell/node-pty-linux-x64/pty.node"));
  assert.ok(files.includes("node_modules/@lydell/node-pty/package.json"));
  assert.deepEqual(files.filter((f) => !f.startsWith("node_modules/@lydell/node-pty")).sort(), ["agent.mjs", "kernels/js-kernel.mjs", "kernels/python_bridge.py", "kernels/python_kernel.py", "native/xattr.node"]);
});

test("the bundled agent keeps file metadata as user.e2b.* xattrs through its addon, and reads those set by others", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-agent-xattr-"));
  try {
    const written = await agent.client.writeFile(join(dir, "a.txt"), Buffer.from("x"), { metadata: { owner: "kiln" } });
    assert.deepEqual(written.metadata, { owner: "kiln" });
    assert.equal(execFileSync("getfattr", ["--only-values", "-n", "user.e2b.owner", join(dir, "a.txt")], { encoding: "utf8" }), "kiln");
    execFileSync("setfattr", ["-n", "user.e2b.set-by", "-v", "setfattr", join(dir, "a.txt")]);
    execFileSync("setfattr", ["-n", "user.unrelated", "-v", "x", join(dir, "a.txt")]);
    assert.deepEqual((await agent.client.info(join(dir, "a.txt"))).metadata, { owner: "kiln", "set-by": "setfattr" });
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test("the bundled agent runs commands and PTYs", async () => {
  const r = await agent.client.exec({ cmd: "echo bundled" });
  assert.equal(text(r.stdout_base64), "bundled\n");
  const c = await openStream(agent);
  c.send({ type: "pty.start", request_id: "b", cmd: "/bin/sh", args: [], cols: 50, rows: 7 });
  const { session_id: s } = await c.next((f) => f.type === "pty.started");
  c.send({ type: "pty.input", session_id: s, data: "stty size; exit\r" });
  await c.ptyUntil(s, /7 50/);
  assert.equal((await c.next((f) => f.type === "pty.exit")).exit_code, 0);
  await c.close();
});

test("the bundled Node kernel runs on its own (acorn inside): top-level await across cells", async () => {
  const ctx = await agent.client.codeCreate({ id: "ctx_bundle0test", language: "javascript", cwd: "/tmp", user: "root" });
  assert.ok(ctx.kernel_pid);
  const run = async (code: string) => {
    const body = await agent.client.codeExecute({ code, context_id: ctx.id });
    let text = "";
    for await (const chunk of body) text += chunk;
    return text.split("\n").filter(Boolean).map((l) => JSON.parse(l));
  };
  await run("const v = await Promise.resolve(21)");
  const frames = await run("v * 2");
  assert.equal(frames.find((f) => f.type === "result")?.data["text/plain"], "42");
  assert.deepEqual(await agent.client.codeDelete(ctx.id), { deleted: true });
});
