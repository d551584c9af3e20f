// An E2B template build across hosts: three servers on one PostgreSQL behind a (test) load balancer that sends each
// of the `e2b` SDK's calls to a different server — the build request to a, the upload links to c, the uploads to b,
// the build start to c, the status polls to b and c. The build runs on a (the host that took the request), where the
// uploads are kept, bounded and private; b and c keep nothing; a sandbox of the template then runs on c, which
// fetched the layers it lacked. A forged upload link is refused by the server that took it.

import { test, after } from "node:test";
import assert from "node:assert/strict";
import { createServer, request as httpRequest } from "node:http";
import type { IncomingMessage } from "node:http";
import { existsSync, statSync } from "node:fs";
import { mkdtemp, readdir, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createHash, randomBytes } from "node:crypto";
import { request } from "undici";
import { Sandbox, Template } from "e2b";
import { query, startPostgres } from "../support/postgres.ts";
import { freePort } from "../support/net.ts";
import { startServerProcess } from "../webhooks/server-process.ts";
import type { ServerProcess } from "../webhooks/server-process.ts";

const UPLOAD_LIMIT = 1024 * 1024;
const cleanups: (() => Promise<unknown>)[] = [];
after(async () => {
  for (const fn of cleanups.reverse()) await fn().catch((err: unknown) => console.error("cleanup failed:", err));
});

test("an E2B template build whose calls each reach another server builds on one host; a sandbox of it runs on a third", async () => {
  const db = await startPostgres();
  cleanups.push(() => db.stop());

  // The load balancer: each kind of call to its server, recorded.
  const servers = new Map<string, ServerProcess>();
  const seen: string[] = [];
  let polls = 0;
  const pick = (req: IncomingMessage): [string, string] => {
    const path = req.url ?? "";
    if (req.method === "POST" && path === "/v3/templates") return ["request", "h-a"];
    if (req.method === "GET" && /^\/templates\/[^/]+\/files\//.test(path)) return ["link", "h-c"];
    if (req.method === "PUT" && path.startsWith("/e2b-template-files/")) return ["upload", "h-b"];
    if (req.method === "POST" && /^\/v2\/templates\/[^/]+\/builds\//.test(path)) return ["start", "h-c"];
    if (req.method === "GET" && /\/status(\?|$)/.test(path)) return ["status", polls++ % 2 ? "h-c" : "h-b"];
    return ["other", "h-b"];
  };
  const lbPort = await freePort();
  const lb = createServer((req, res) => {
    const [kind, to] = pick(req);
    seen.push(`${kind}:${to}`);
    const target = new URL(servers.get(to)!.url);
    const up = httpRequest({ host: target.hostname, port: target.port, method: req.method, path: req.url, headers: req.headers }, (answer) => {
      res.writeHead(answer.statusCode ?? 502, answer.headers);
      answer.pipe(res);
    });
    up.on("error", () => res.destroy());
    req.pipe(up);
  });
  await new Promise<void>((resolve) => lb.listen(lbPort, "127.0.0.1", resolve));
  cleanups.push(() => new Promise((resolve) => lb.close(resolve)));
  const lbUrl = `http://127.0.0.1:${lbPort}`;

  const dirs = new Map<string, string>();
  cleanups.push(async () => {
    for (const s of servers.values()) await s.stop().catch(() => undefined);
    for (const d of dirs.values()) await rm(d, { recursive: true, force: true });
  });
  // One after the other: each registers the shared base template in turn. Every server's public URL is the balancer.
  for (const id of ["h-a", "h-b", "h-c"]) {
    const dir = await mkdtemp(join(tmpdir(), `kiln-e2b-${id}-`));
    dirs.set(id, dir);
    servers.set(id, await startServerProcess(dir, { KILN_DATABASE_URL: db.url, KILN_HOST_ID: id, KILN_HOST_HEARTBEAT_MS: "500", KILN_PUBLIC_URL: lbUrl, KILN_BODY_LIMIT_BYTES: String(UPLOAD_LIMIT), KILN_LOG_LEVEL: "info" }));
  }
  const [a, b, c] = ["h-a", "h-b", "h-c"].map((id) => servers.get(id)!);
  const e2bKey = (await a.call("POST", "/v1/keys", { name: "e2b-lb", format: "e2b" })).body.key as string;

  const ctx = await mkdtemp(join(tmpdir(), "e2b-lb-ctx-"));
  cleanups.push(() => rm(ctx, { recursive: true, force: true }));
  await writeFile(join(ctx, "hello.txt"), "uploaded through b\n");
  const tpl = Template({ fileContextPath: ctx }).fromBaseImage().copy("hello.txt", "/opt/hello.txt").runCmd("cat /opt/hello.txt > /opt/built.txt");
  const info = await Template.build(tpl, "across-hosts", { apiKey: e2bKey, apiUrl: lbUrl, requestTimeoutMs: 60_000 });
  for (const call of ["request:h-a", "link:h-c", "upload:h-b", "start:h-c", "status:h-b", "status:h-c"]) assert.ok(seen.includes(call), `${call} in ${seen.join(", ")}`);

  // Built on a, where the request was taken; the upload kept there only, private.
  const [build] = await query<{ host_id: string; status: string }>(db.url, "select host_id, status from builds where id = $1", [info.buildId]);
  assert.deepEqual(build, { host_id: "h-a", status: "ready" });
  const kept = join(dirs.get("h-a")!, "e2b-template-files");
  assert.equal(statSync(kept).mode & 0o777, 0o700);
  const uploads = await readdir(kept);
  assert.equal(uploads.length, 1);
  assert.equal(statSync(join(kept, uploads[0])).mode & 0o077, 0, "the upload is private");
  for (const id of ["h-b", "h-c"]) assert.equal(existsSync(join(dirs.get(id)!, "e2b-template-files")), false, `${id} keeps no upload`);

  // With a and b draining, a sandbox of it created through c runs on c, from layers c fetched from a.
  for (const h of ["h-a", "h-b"]) assert.equal((await c.call("POST", `/v1/hosts/${h}/drain`)).status, 200);
  const sbx = await Sandbox.create("across-hosts", { apiKey: e2bKey, apiUrl: c.url, sandboxUrl: c.url, requestTimeoutMs: 60_000, timeoutMs: 120_000 });
  try {
    const [machine] = await query<{ host_id: string }>(db.url, "select host_id from machines where id = $1", [`mch_${sbx.sandboxId}`]);
    assert.equal(machine.host_id, "h-c");
    assert.equal((await sbx.commands.run("cat /opt/built.txt")).stdout, "uploaded through b\n");
  } finally {
    await sbx.kill();
  }
  for (const h of ["h-a", "h-b"]) assert.equal((await c.call("POST", `/v1/hosts/${h}/activate`)).status, 200);

  // By hand: a requested build on a, an upload link asked of c. A body past the limit sent through b is refused by a
  // (413) and nothing is kept; a link re-aimed at another host is refused by the server that took it.
  const headers = { "x-api-key": e2bKey, "content-type": "application/json" };
  const requested = await request(`${lbUrl}/v3/templates`, { method: "POST", headers, body: JSON.stringify({ name: "across-hostile" }) });
  const { templateID } = (await requested.body.json()) as { templateID: string };
  assert.equal(requested.statusCode, 202);
  const hash = createHash("sha256").update(randomBytes(16)).digest("hex");
  const linked = await request(`${lbUrl}/templates/${templateID}/files/${hash}`, { headers });
  const link = (await linked.body.json()) as { present: boolean; url: string };
  assert.equal(link.present, false);
  const url = new URL(link.url);
  assert.equal(url.origin, lbUrl, "the link is the public URL");
  assert.equal(url.searchParams.get("host"), "h-a", "the link names the host that builds");
  const huge = await request(`${b.url}${url.pathname}${url.search}`, { method: "PUT", body: Buffer.alloc(UPLOAD_LIMIT + 1) });
  assert.equal(huge.statusCode, 413, await huge.body.text());
  const reaimed = new URL(url);
  reaimed.searchParams.set("host", "h-b");
  const forged = await request(`${c.url}${reaimed.pathname}${reaimed.search}`, { method: "PUT", body: "x" });
  assert.equal(forged.statusCode, 401, await forged.body.text());
  assert.deepEqual(await readdir(kept), uploads, "nothing more kept on a");
  assert.equal(existsSync(join(dirs.get("h-b")!, "e2b-template-files")), false);
});
