// The bundled agent (an entry, one esbuild file, its compile cache, node-pty's prebuilt binary) runs on its own, away
// from the project's node_modules: exec over HTTP and a PTY over the stream socket prove what a machine will run.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { cp, mkdtemp, readdir, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";
import { execFileSync, spawn } from "node:child_process";
import { bundleAgent } from "../../src/agent/bundle.ts";
import { startAgent, openStream, text } from "./support.ts";
import type { TestAgent } from "./support.ts";

let outDir: string;
let agent: TestAgent;
before(async () => {
  // Outside the checkout, so nothing can resolve from the project's node_modules.
  outDir = await mkdtemp(join(tmpdir(), "kiln-agent-bundle-"));
  await bundleAgent(outDir);
  agent = await startAgent({ entry: join(outDir, "agent.cjs") });
});
after(async () => {
  await agent?.stop();
  await rm(outDir, { recursive: true, force: true });
});

test("the bundle is an entry, the agent, its compile cache, the kernels' files, node-pty's runtime files and the xattr addon", async () => {
  const files = (await readdir(outDir, { recursive: true, withFileTypes: true })).filter((e) => e.isFile()).map((e) => relative(outDir, join(e.parentPath, e.name)));
  assert.ok(files.includes("node_modules/@lydell/node-pty-linux-x64/pty.node"));
  assert.ok(files.includes("node_modules/@lydell/node-pty/package.json"));
  const own = files.filter((f) => !f.startsWith("node_modules/@lydell/node-pty")).sort();
  // One cache entry, the agent's (the entry itself is tiny and compiled before the cache is on), under Node's version.
  const cache = own.filter((f) => f.startsWith("compile-cache/"));
  assert.equal(cache.length, 1, own.join(" "));
  assert.match(cache[0], new RegExp(`^compile-cache/${process.version}-${process.arch}-[0-9a-f]+-\\d+/[0-9a-f]+$`));
  assert.deepEqual(own.filter((f) => !f.startsWith("compile-cache/")), ["agent.cjs", "kernels/js-kernel.mjs", "kernels/python_bridge.py", "kernels/python_kernel.py", "main.cjs", "native/xattr.node"]);
});

/** Starts the bundle in `dir` with Node's compile-cache debug log on; its health and what that log said. */
async function startLogged(dir: string): Promise<{ health: any; log: string }> {
  const run = await mkdtemp(join(tmpdir(), "kiln-agent-cache-run-"));
  const child = spawn(process.execPath, [join(dir, "agent.cjs"), "--socket", join(run, "agent.sock")], { stdio: ["ignore", "ignore", "pipe"], env: { PATH: process.env.PATH, TMPDIR: run, NODE_DEBUG_NATIVE: "COMPILE_CACHE" } });
  let log = "";
  child.stderr.on("data", (c: Buffer) => (log += c.toString()));
  const exited = new Promise((r) => child.once("exit", r));
  try {
    const { createAgentClient } = await import("../../src/runtime/agent-client.ts");
    const client = createAgentClient(join(run, "agent.sock"));
    const deadline = Date.now() + 10_000;
    for (;;) {
      const health = await client.health().catch(() => undefined);
      if (health) {
        await client.close();
        return { health, log };
      }
      assert.ok(Date.now() < deadline && child.exitCode === null, `the agent did not come up: ${log}`);
      await new Promise((r) => setTimeout(r, 20));
    }
  } finally {
    child.kill("SIGTERM");
    await exited;
    await rm(run, { recursive: true, force: true });
  }
}

test("the bundled agent is compiled from the cache made with the bundle, and names it in its health", async () => {
  const { health, log } = await startLogged(outDir);
  assert.match(log, /V8 code cache for CommonJS \S+\/main\.cjs was accepted/);
  assert.equal(health.compile_cache.startsWith(join(outDir, "compile-cache")), true, health.compile_cache);
});

test("a damaged compile cache is refused and the agent compiles itself and serves as usual", async () => {
  const copy = await mkdtemp(join(tmpdir(), "kiln-agent-bundle-damaged-"));
  try {
    await cp(outDir, copy, { recursive: true });
    const entry = (await readdir(join(copy, "compile-cache"), { recursive: true, withFileTypes: true })).find((e) => e.isFile())!;
    const file = join(entry.parentPath, entry.name);
    const bytes = await readFile(file);
    for (let i = 64; i < bytes.length; i += 97) bytes[i] ^= 0x5a;
    await writeFile(file, bytes);
    const { health, log } = await startLogged(copy);
    assert.equal(health.ok, true);
    assert.match(log, /main\.cjs\.\.\.\[[^\]]*\]\.\.\.cache hash mismatch/);
    assert.doesNotMatch(log, /was accepted/);
  } finally {
    await rm(copy, { recursive: true, force: true });
  }
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
