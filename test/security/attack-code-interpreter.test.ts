// E2B SDK clients against the code interpreter's routes (issue 25), with real sandboxes: no token, another sandbox's
// token (by Host and by E2b-Sandbox-Id, and the two mixed), oversized env_vars and code, and a secret passed as a
// per-run env var reaching neither the logs nor the data dir.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { request } from "undici";
import { Sandbox } from "@e2b/code-interpreter";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";

let k: TestKiln;
let a: Sandbox;
let b: Sandbox;

before(async () => {
  k = await startTestKiln({ captureLogs: true });
  const key = (await k.kiln.services.keys.create("atk-ci", generateKeyIn("e2b"))).key;
  const opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 60_000, timeoutMs: 600_000 };
  [a, b] = await Promise.all([Sandbox.create("base", opts), Sandbox.create("base", opts)]);
});
after(async () => {
  await Promise.all([a?.kill().catch(() => {}), b?.kill().catch(() => {})]);
  await k?.close();
});

async function call(method: "GET" | "POST", path: string, headers: Record<string, string>, body?: unknown) {
  const res = await request(`${k.url}${path}`, {
    method,
    reset: true,
    headers: { ...headers, ...(body === undefined ? {} : { "content-type": "application/json" }) },
    body: body === undefined ? undefined : typeof body === "string" ? body : JSON.stringify(body),
  });
  return { status: res.statusCode, text: await res.body.text() };
}

test("a code-interpreter route answers only its own sandbox's token: none, another sandbox's, or a mixed Host and E2b-Sandbox-Id are 401", async () => {
  const hostB = `49999-${b.sandboxId}.kiln.test`;
  const tokenA = a.trafficAccessToken!;
  const tries: [string, Record<string, string>][] = [
    ["no token", { host: hostB }],
    ["A's token, B's Host", { host: hostB, "x-access-token": tokenA }],
    ["A's traffic token, B's Host", { host: hostB, "e2b-traffic-access-token": tokenA }],
    ["A's token, E2b-Sandbox-Id B", { "e2b-sandbox-id": b.sandboxId, "e2b-sandbox-port": "49999", "x-access-token": tokenA }],
    ["A's token, A's Host, E2b-Sandbox-Id B", { host: `49999-${a.sandboxId}.kiln.test`, "e2b-sandbox-id": b.sandboxId, "x-access-token": tokenA }],
    ["A's token with B's id put in front", { host: hostB, "x-access-token": `${tokenA.split(".")[0]}.${b.trafficAccessToken!.split(".")[1]}x` }],
  ];
  for (const [what, headers] of tries) {
    for (const [method, path, body] of [["POST", "/execute", { code: "open('/tmp/pwned','w').write('x')" }], ["GET", "/contexts"], ["POST", "/contexts", {}], ["GET", "/health"]] as const) {
      const res = await call(method, path, headers, body);
      assert.equal(res.status, 401, `${what}: ${method} ${path} → ${res.status} ${res.text.slice(0, 200)}`);
    }
  }
  // Nothing ran in B.
  assert.equal((await b.runCode("import os; os.path.exists('/tmp/pwned')")).text, "False");
  // Its own token works.
  const own = await call("POST", "/execute", { host: hostB, "x-access-token": b.trafficAccessToken! }, { code: "6 * 7" });
  assert.equal(own.status, 200, own.text);
});

test("env_vars the kernel would refuse (a bad name, a NUL, too many or too large) and oversized code are a 400 or 413 answer, not a dropped connection; the server goes on", async () => {
  const headers = { host: `49999-${a.sandboxId}.kiln.test`, "x-access-token": a.trafficAccessToken! };
  const many = Object.fromEntries(Array.from({ length: 300 }, (_, i) => [`V${i}`, "x"]));
  for (const [what, env_vars] of [["a bad name", { "BAD-NAME": "x" }], ["300 names", many], ["a bad name again", { "BAD-NAME": "x" }], ["a 40 KiB value", { LD_PRELOAD: "y".repeat(40 * 1024) }], ["a NUL in a value", { X: "a\u0000b" }], ["100 KiB in all", { A: "a".repeat(30_000), B: "b".repeat(30_000), C: "c".repeat(30_000), D: "d".repeat(30_000) }]] as const) {
    const res = await call("POST", "/execute", headers, { code: "1", env_vars }).catch((err: Error) => ({ status: 0, text: String(err) }));
    assert.equal(res.status, 400, `${what}: ${res.status} ${res.text.slice(0, 300)}`);
  }
  // Past the body limit the server answers 413 before reading and closes: the client may only see the close.
  const huge = await call("POST", "/execute", headers, { code: "#" + "x".repeat(3 * 1024 * 1024) }).catch((err: Error) => ({ status: 0, text: String(err) }));
  assert.ok(huge.status === 413 || huge.status === 400 || /other side closed|ECONNRESET|EPIPE/.test(huge.text), `${huge.status} ${huge.text.slice(0, 200)}`);
  const after = await call("POST", "/execute", headers, { code: "6 * 7" });
  assert.equal(after.status, 200, after.text);
  assert.match(after.text, /"text":"42"/);
});

test("a secret passed as a per-run env var reaches neither the server's logs nor its data dir", async () => {
  const marker = `atk24-envsecret-${Date.now().toString(36)}`;
  const e = await a.runCode("import os; len(os.environ['ATK_SECRET'])", { envs: { ATK_SECRET: marker } });
  assert.equal(e.text, String(marker.length));
  assert.ok(!k.logs.join("").includes(marker), "not in the logs");
  const hits: string[] = [];
  const walk = (dir: string) => {
    for (const name of readdirSync(dir)) {
      const p = join(dir, name);
      let st;
      try {
        st = statSync(p);
      } catch {
        continue;
      }
      if (st.isDirectory()) {
        if (name === "machines" || name === "cache" || name === "disks") continue; // the sandbox's own filesystem and disks
        walk(p);
      } else if (st.isFile() && st.size < 64 * 1024 * 1024 && readFileSync(p).includes(marker)) hits.push(p);
    }
  };
  walk(k.dataDir);
  assert.deepEqual(hits, [], "not in the data dir (store, events, records)");
});
