// A holder of a sandbox's token against the server's memory (issue 25's E2B surface): the answers Kiln streams to an
// E2B client — a code-interpreter execution's NDJSON, an envd process stream — are read by a client that does not
// read. Kiln must not hold what the sandbox writes without bound for it: the execution is paced by its reader (as
// the native code/execute is), a process stream that falls too far behind ends with `resource_exhausted`.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { setTimeout as sleep } from "node:timers/promises";
import { Sandbox } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startUnread, readOn } from "../support/unread.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { envelope } from "../../src/compat/e2b/connect.ts";

let k: TestKiln;
let sbx: Sandbox;

before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  const key = (await k.kiln.services.keys.create("attack-e2b-streams", generateKeyIn("e2b"))).key;
  sbx = await Sandbox.create("base", { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 60_000, timeoutMs: 600_000 });
});
after(async () => {
  await sbx?.kill().catch(() => undefined);
  await k?.close();
});

const sandboxHeaders = (port: number) => ({ "e2b-sandbox-id": sbx.sandboxId, "e2b-sandbox-port": String(port), "x-access-token": sbx.trafficAccessToken! });

/** POSTs to the sandbox's `port` (E2b-Sandbox-Id, its token) and hands back the response unread (paused). */
const startUnreadIn = (path: string, port: number, contentType: string, body: Buffer | string) =>
  startUnread(new URL(path, k.url), { ...sandboxHeaders(port), "content-type": contentType }, body);

test("an execution whose client does not read is paced: the kernel waits for its reader instead of the server holding its flood", async () => {
  // The kernel counts the 4 KB lines it got out, in a file the test reads through envd meanwhile.
  const code = `const fs = require("fs"); const line = "y".repeat(4000); for (let n = 1; ; n++) { console.log(line); if (n % 250 === 0) fs.writeFileSync("/tmp/flood-count", String(n)) }`;
  const unread = await startUnreadIn("/execute", 49999, "application/json", JSON.stringify({ code, language: "js" }));
  assert.equal(unread.statusCode, 200);
  // Paced, the kernel stops once the buffers between it and the client are full; unpaced, the server takes all it
  // writes (tens of MB a second) and the count runs on. Wait for the count to stand still, or to pass 256 MB.
  const count = async () => Number((await sbx.files.read("/tmp/flood-count").catch(() => "0")) || 0);
  let last = -1;
  for (;;) {
    const n = await count();
    assert.ok(n * 4000 < 256 * 1024 * 1024, `the kernel got ${Math.round((n * 4000) / 1024 / 1024)} MB out to a client that read nothing: the server held it`);
    if (n > 0 && n === last) break;
    last = n;
    await sleep(2000);
  }
  // Reading on hands over what waited, and the kernel goes on.
  const got = (await readOn(unread, 4 * 1024 * 1024)).length;
  assert.ok(got > 4 * 1024 * 1024, `the client read ${got} bytes once it read`);
  // The sandbox goes on: a new execution answers.
  const res = await fetch(new URL("/execute", k.url), { method: "POST", headers: { ...sandboxHeaders(49999), "content-type": "application/json" }, body: JSON.stringify({ code: "6 * 7" }) });
  assert.match(await res.text(), /"text":"42"/);
});

test("a process stream whose client does not read ends with resource_exhausted once 32 MiB wait for it; the process goes on", async () => {
  // 100 MB of output, then a mark, then the process lives on.
  const script = "head -c 100000000 /dev/zero; touch /tmp/flood-done; exec sleep 600";
  const unread = await startUnreadIn("/process.Process/Start", 49983, "application/connect+json", envelope(0, { process: { cmd: "/bin/sh", args: ["-c", script] } }));
  assert.equal(unread.statusCode, 200);
  // Once the process wrote it all, the server has had all of it (nothing paces an envd stream: one agent socket
  // carries every process of the machine).
  while (!(await sbx.files.exists("/tmp/flood-done"))) await sleep(500);
  // What was held is handed over, then the end frame says why the stream ended. Unbounded, the stream holds all
  // 100 MB (133 MB as base64 in JSON) and never ends: reading stops past 64 MiB.
  const all = await readOn(unread, 64 * 1024 * 1024);
  assert.ok(all.length <= 40 * 1024 * 1024, `the server held ${Math.round(all.length / 1024 / 1024)} MiB for a client that read nothing`);
  let at = 0;
  let end: { error?: { code: string; message: string } } | undefined;
  let pid: number | undefined;
  while (at + 5 <= all.length) {
    const flags = all.readUInt8(at);
    const len = all.readUInt32BE(at + 1);
    const msg = JSON.parse(all.subarray(at + 5, at + 5 + len).toString());
    if (flags & 0x02) end = msg;
    else pid ??= msg.event?.start?.pid;
    at += 5 + len;
  }
  assert.equal(end?.error?.code, "resource_exhausted", `the end frame: ${JSON.stringify(end)}`);
  assert.match(end!.error!.message, /32 MiB behind/);
  assert.ok(pid, "the stream began with the process's start");
  // The process itself goes on (envd's streams end, processes do not); its owner may kill it.
  const listed = await sbx.commands.list();
  assert.ok(listed.some((p) => p.pid === pid), `pid ${pid} still runs: ${JSON.stringify(listed.map((p) => p.pid))}`);
  await sbx.commands.kill(pid!);
  assert.equal((await sbx.commands.run("echo ok")).stdout, "ok\n");
});
