// The guest agent's one-shot exec (POST /exec) and its small routes, driven through agent-client: argv vs shell,
// exit codes and signals, stdin, timeouts that kill the whole group, envs, users from the machine's passwd.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readFile } from "node:fs/promises";
import { createAgentClient, AgentError } from "../../src/runtime/agent-client.ts";
import { startAgent, ALL_BYTES, text } from "./support.ts";
import type { TestAgent } from "./support.ts";

let agent: TestAgent;
before(async () => {
  // Something of the agent's own environment that must never reach what it spawns.
  agent = await startAgent({ env: { KILN_AGENT_SECRET: "leak-me-not" } });
});
after(() => agent?.stop());

test("health answers with this boot's id", async () => {
  const h = await agent.client.health();
  assert.equal(h.ok, true);
  assert.match(h.boot_id, /^[0-9a-f-]{36}$/);
  assert.equal(h.pid, agent.child.pid);
});

test("without args cmd is a shell line; with args it is the program and its argv, unexpanded", async () => {
  const shell = await agent.client.exec({ cmd: "echo $((1+2)) | tr 3 x" });
  assert.equal(text(shell.stdout_base64), "x\n");
  const argv = await agent.client.exec({ cmd: "printf", args: ["%s|", "$HOME", "a b", "*"] });
  assert.equal(text(argv.stdout_base64), "$HOME|a b|*|");
  assert.equal(argv.exit_code, 0);
  assert.equal(argv.timed_out, false);
});

test("exit codes, signals and stderr are reported", async () => {
  const r = await agent.client.exec({ cmd: "echo oops >&2; exit 7" });
  assert.equal(r.exit_code, 7);
  assert.equal(r.signal, null);
  assert.equal(text(r.stderr_base64), "oops\n");
  const killed = await agent.client.exec({ cmd: "kill -TERM $$" });
  assert.equal(killed.exit_code, null);
  assert.equal(killed.signal, "SIGTERM");
});

test("stdin bytes reach the process and come back byte for byte", async () => {
  const r = await agent.client.exec({ cmd: "cat", args: [], stdin_base64: ALL_BYTES.toString("base64") });
  assert.deepEqual(Buffer.from(r.stdout_base64, "base64"), ALL_BYTES);
  const none = await agent.client.exec({ cmd: "cat" });
  assert.equal(none.stdout_base64, "", "without stdin the process reads an empty stdin");
});

test("a timeout kills the whole process group and says so", async () => {
  const started = Date.now();
  const r = await agent.client.exec({ cmd: "sleep 30 & echo $! > /tmp/kiln-agent-bg.$PPID; sleep 30", timeout_ms: 300 });
  assert.equal(r.timed_out, true);
  assert.equal(r.signal, "SIGKILL");
  assert.ok(Date.now() - started < 5_000);
  const bg = await agent.client.exec({ cmd: "cat /tmp/kiln-agent-bg.* && rm -f /tmp/kiln-agent-bg.*" });
  const pid = Number(text(bg.stdout_base64).trim());
  assert.ok(pid > 0);
  await new Promise((r) => setTimeout(r, 100));
  // Gone, or a zombie waiting for init to reap it (tini does that in a machine).
  const state = await readFile(`/proc/${pid}/stat`, "utf8").then((s) => s.slice(s.lastIndexOf(")") + 2, s.lastIndexOf(")") + 3), () => "gone");
  assert.ok(state === "gone" || state === "Z", `the background child died with its group (state ${state})`);
});

test("the default env is the machine's, PUT /envs adds defaults, request envs win, the agent's own env never leaks", async () => {
  const env = async (envs?: Record<string, string>) => {
    const r = await agent.client.exec({ cmd: "env", args: [], envs });
    return Object.fromEntries(text(r.stdout_base64).trim().split("\n").map((l) => [l.slice(0, l.indexOf("=")), l.slice(l.indexOf("=") + 1)]));
  };
  const plain = await env();
  assert.equal(plain.LANG, "C.UTF-8");
  assert.equal(plain.HOME, "/root");
  assert.equal(plain.USER, "root");
  assert.match(plain.PATH, /\/usr\/bin/);
  assert.equal(plain.KILN_AGENT_SECRET, undefined);
  assert.ok(!Object.values(plain).some((v) => v.includes("node_modules")), "no path of the agent's runtime reaches the process");
  await agent.client.setEnvs({ MACHINE_VAR: "from-create", LANG: "de_DE.UTF-8" });
  const withDefaults = await env({ REQ: "1", MACHINE_VAR: "from-request" });
  assert.equal(withDefaults.LANG, "de_DE.UTF-8");
  assert.equal(withDefaults.MACHINE_VAR, "from-request");
  assert.equal(withDefaults.REQ, "1");
  assert.equal((await env()).MACHINE_VAR, "from-create");
  await agent.client.setEnvs({});
  assert.equal((await env()).MACHINE_VAR, undefined);
});

test("a user from the machine's passwd runs the process with its uid, gid, home and names", async () => {
  const nobody = await agent.client.user("nobody");
  assert.equal(nobody.uid, 65534);
  const r = await agent.client.exec({ cmd: 'echo "$(id -u) $(id -g) $HOME $USER $LOGNAME"', user: "nobody", cwd: "/" });
  assert.equal(text(r.stdout_base64).trim(), `65534 ${nobody.gid} ${nobody.home} nobody nobody`);
  const cwd = await agent.client.exec({ cmd: "pwd", cwd: "/tmp" });
  assert.equal(text(cwd.stdout_base64), "/tmp\n");
});

test("bad requests are AgentErrors with code and status", async () => {
  const cases: [() => Promise<unknown>, string, number][] = [
    [() => agent.client.exec({ cmd: "true", user: "no-such-user" }), "invalid_request", 400],
    [() => agent.client.exec({ cmd: "/no/such/program", args: [] }), "invalid_request", 400],
    [() => agent.client.exec({ cmd: "true", cwd: "/no/such/dir" }), "invalid_request", 400],
    [() => agent.client.exec({ cmd: "" }), "invalid_request", 400],
    [() => agent.client.user("no-such-user"), "not_found", 404],
  ];
  // One at a time: a rejection nobody awaits yet would count as unhandled.
  for (const [call, code, status] of cases) {
    await assert.rejects(call(), (err: unknown) => err instanceof AgentError && err.code === code && err.status === status && err.message.length > 0);
  }
});

test("output beyond 16 MiB is cut and the cut is said", async () => {
  const r = await agent.client.exec({ cmd: "head -c 17000000 /dev/zero" });
  const out = Buffer.from(r.stdout_base64, "base64");
  assert.ok(out.length < 17_000_000 && out.length > 16 * 1024 * 1024);
  assert.match(out.subarray(16 * 1024 * 1024).toString(), /output truncated at 16777216 bytes of 17000000/);
});

test("an agent that is not there is 'unavailable', not an agent error", async () => {
  const c = createAgentClient(`${agent.dir}/nothing-here.sock`);
  await assert.rejects(c.health(), (err: unknown) => err instanceof AgentError && err.code === "unavailable" && err.status === 503);
  await c.close();
});
