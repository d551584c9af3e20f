// The agent client's memo of users (src/runtime/agent-client.ts): a user found is kept for the client's life so a
// machine's calls do not ask the agent again, but only up to 64 of them — past that the memo starts over, and every
// lookup, the 65th included, still answers the user asked for. Driven against a stand-in agent on a unix socket that
// counts the lookups it answers.

import { test } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createAgentClient } from "../../src/runtime/agent-client.ts";

test("the user memo: 64 users kept, the 65th still answered right, and the memo bounded past it", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-agent-users-"));
  const asked = new Map<string, number>();
  const server = createServer((req, res) => {
    const name = decodeURIComponent(/^\/users\/([^/?]+)$/.exec(req.url ?? "")?.[1] ?? "");
    const uid = Number(/^u(\d+)$/.exec(name)?.[1] ?? NaN);
    asked.set(name, (asked.get(name) ?? 0) + 1);
    if (!Number.isInteger(uid)) {
      res.writeHead(404, { "content-type": "application/json" }).end(JSON.stringify({ error: `no user ${name}`, code: "not_found" }));
      return;
    }
    res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify({ name, uid: 1000 + uid, gid: 1000 + uid, home: `/home/${name}`, shell: "/bin/sh" }));
  });
  const socket = join(dir, "agent.sock");
  await new Promise<void>((r) => server.listen(socket, r));
  const agent = createAgentClient(socket);
  try {
    for (let i = 0; i < 64; i++) assert.equal((await agent.user(`u${i}`)).uid, 1000 + i);
    // All 64 are remembered: asking again reaches the agent for none of them.
    for (let i = 0; i < 64; i++) assert.equal((await agent.user(`u${i}`)).uid, 1000 + i);
    for (let i = 0; i < 64; i++) assert.equal(asked.get(`u${i}`), 1, `u${i} was asked for again`);

    // The 65th: answered for itself, not from what the full memo held.
    const sixtyFifth = await agent.user("u64");
    assert.deepEqual(sixtyFifth, { name: "u64", uid: 1064, gid: 1064, home: "/home/u64", shell: "/bin/sh" });
    assert.equal(asked.get("u64"), 1);
    // Bounded: the memo started over at the 65th, so the earlier ones are asked for again (and still answered right),
    // while the newest is kept.
    assert.equal((await agent.user("u0")).uid, 1000);
    assert.equal(asked.get("u0"), 2, "u0 was still remembered past 64 users");
    assert.equal((await agent.user("u64")).uid, 1064);
    assert.equal(asked.get("u64"), 1);

    // A user not found is not remembered: asked again next time (a user made later is then found).
    await assert.rejects(agent.user("nobody-here"), (err: Error & { code?: string }) => err.code === "not_found");
    await assert.rejects(agent.user("nobody-here"));
    assert.equal(asked.get("nobody-here"), 2);
  } finally {
    await agent.close();
    await new Promise((r) => server.close(r));
    await rm(dir, { recursive: true, force: true });
  }
});
