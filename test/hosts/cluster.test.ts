// Many hosts, one platform: three real servers (their own processes, ports and data dirs) on one real PostgreSQL.
// The hosts list, placement spread across hosts, exec / files / the machine WebSocket through a server that does not
// run the machine, drain and activate, forged and absent cluster authentication refused, and a host killed with
// SIGKILL: marked lost within the bound, its machine failed with the reason and its webhook delivered once, the other
// hosts unaffected, and nothing of it left running once its server starts again.

import { test, after } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { createHash, createHmac } from "node:crypto";
import { existsSync } from "node:fs";
import { request as httpRequest } from "node:http";
import { mkdtemp, readdir, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { request } from "undici";
import { Sandbox } from "e2b";
import { WebSocket } from "ws";
import { connect as connectTcp, createServer as createTcpServer } from "node:net";
import type { Socket } from "node:net";
import { query, startPostgres } from "../support/postgres.ts";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import { createTunnelServer } from "../../src/hosts/tunnel.ts";
import { DEFAULT_PROXY_LIMITS } from "../../src/deployments/proxy-limits.ts";
import { collectFrames } from "../support/frames.ts";
import { TEST_RUNTIME } from "../support/paths.ts";
import { startServerProcess } from "../webhooks/server-process.ts";
import type { ServerProcess } from "../webhooks/server-process.ts";
import { startReceiver } from "../webhooks/receiver.ts";
import { appCommand } from "../deployments/support.ts";

// Generous for a loaded CI host: a server whose event loop stalls past this is (rightly) taken for lost.
const LOST_AFTER_S = 8;
const HEARTBEAT_MS = 500;

const cleanups: (() => Promise<unknown>)[] = [];
after(async () => {
  for (const fn of cleanups.reverse()) await fn().catch((err: unknown) => console.error("cleanup failed:", err));
});

async function until<T>(what: string, check: () => Promise<T | undefined | false>, timeoutMs = 30_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = await check();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

async function raw(url: string, method: string, headers: Record<string, string>, body?: string) {
  const res = await request(url, { method: method as "GET", headers, body });
  const text = await res.body.text();
  return { status: res.statusCode, body: text ? JSON.parse(text) : undefined };
}

/** A create through `via`, waiting out the moment after start when the base template is still being registered. */
async function create(via: ServerProcess, body: Record<string, unknown> = {}): Promise<{ id: string; host_id?: string }> {
  for (let i = 0; ; i++) {
    const res = await via.call("POST", "/v1/machines", body);
    if (res.status === 201) return res.body;
    if (res.status !== 503 || i > 300) throw new Error(`machine create answered ${res.status}: ${JSON.stringify(res.body)}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

test("three servers on one PostgreSQL: hosts, placement, forwarding, drain, cluster auth and a lost host", async () => {
  const db = await startPostgres();
  cleanups.push(() => db.stop());
  const rx = await startReceiver();
  cleanups.push(() => rx.close());
  const dirs: string[] = [];
  const servers = new Map<string, ServerProcess>();
  const start = async (id: string, dir?: string, extra: Record<string, string> = {}) => {
    const dataDir = dir ?? (await mkdtemp(join(tmpdir(), `kiln-host-${id}-`)));
    if (!dir) dirs.push(dataDir);
    const s = await startServerProcess(dataDir, {
      KILN_DATABASE_URL: db.url,
      KILN_HOST_ID: id,
      KILN_HOST_NAME: `name-${id}`,
      KILN_HOST_LOST_AFTER_S: String(LOST_AFTER_S),
      KILN_HOST_HEARTBEAT_MS: String(HEARTBEAT_MS),
      KILN_WEBHOOK_ALLOW_PRIVATE: "1",
      KILN_LOG_LEVEL: "info",
      ...extra,
    });
    servers.set(id, s);
    dirOf.set(id, dataDir);
    return { s, dataDir };
  };
  const dirOf = new Map<string, string>();
  cleanups.push(async () => {
    // Whatever happened above: every host's server runs again (a killed one adopts and removes what it left), every
    // machine still live is destroyed through any server, and only then do the servers stop and their dirs go.
    for (const [id, dir] of dirOf) if (!servers.has(id)) await start(id, dir).catch(() => undefined);
    const any = [...servers.values()][0];
    const live: { id: string }[] = any ? await any.call("GET", "/v1/machines?limit=100").then((r) => r.body?.machines ?? [], () => []) : [];
    for (const m of live) await any!.call("DELETE", `/v1/machines/${m.id}`).catch(() => undefined);
    const vols: { id: string }[] = any ? await any.call("GET", "/v1/volumes?limit=100").then((r) => r.body?.volumes ?? [], () => []) : [];
    for (const v of vols) await any!.call("DELETE", `/v1/volumes/${v.id}`).catch(() => undefined);
    for (const s of servers.values()) await s.stop().catch(() => undefined);
    for (const d of dirs) await rm(d, { recursive: true, force: true });
  });
  // One after the other: each registers the shared base template in turn.
  const { s: a } = await start("h-a");
  await create(a).then((m) => a.call("DELETE", `/v1/machines/${m.id}`));
  const { s: b } = await start("h-b");
  // Host c keeps one warm machine: draining it releases that machine (below).
  const { s: c, dataDir: cDir } = await start("h-c", undefined, { KILN_WARM_POOL: "1" });

  // Hosts: every server lists all three, each advertising its own loopback URL.
  const hosts = (await b.call("GET", "/v1/hosts")).body.hosts as any[];
  assert.deepEqual(hosts.map((h) => h.id).sort(), ["h-a", "h-b", "h-c"]);
  for (const h of hosts) {
    assert.equal(h.status, "active");
    assert.equal(h.advertise_url, servers.get(h.id)!.url);
    assert.equal(h.name, `name-${h.id}`);
    assert.ok(h.capacity.cores >= 1 && h.capacity.memory_mb > 0, "capacity reported");
    assert.equal(h.self, h.id === "h-b");
  }
  assert.equal((await a.call("GET", "/v1/hosts/h-c")).body.advertise_url, c.url);
  assert.equal((await a.call("GET", "/v1/hosts/nope")).status, 404);

  const hook = await a.call("POST", "/v1/lifecycle/webhooks", { url: `${rx.url}/lost`, operations: ["destroy"] });
  assert.equal(hook.status, 201);

  // Placement: three creates through one server land on three hosts.
  const placed: { id: string; host: string }[] = [];
  for (let i = 0; i < 3; i++) {
    const m = await create(a);
    const rec = await a.call("GET", `/v1/machines/${m.id}`);
    // A user sees where a machine runs: its record names the host, as the store does.
    assert.equal(rec.body.host_id, await hostOf(db.url, m.id), "the machine view carries host_id");
    placed.push({ id: m.id, host: rec.body.host_id });
  }
  const listed = (await b.call("GET", "/v1/machines?limit=100")).body.machines as { id: string; host_id: string }[];
  for (const p of placed) assert.equal(listed.find((m) => m.id === p.id)?.host_id, p.host, "the machines list carries host_id");
  assert.deepEqual(placed.map((p) => p.host).sort(), ["h-a", "h-b", "h-c"], "one machine on each host");
  const on = (h: string) => placed.find((p) => p.host === h)!.id;

  // Any server answers for any machine: exec, files and the machine WebSocket through a server that does not run it.
  const mb = on("h-b");
  for (const via of [a, c]) {
    const ex = await via.call("POST", `/v1/machines/${mb}/exec`, { cmd: "cat /etc/hostname; echo ok" });
    assert.equal(ex.status, 200, JSON.stringify(ex.body));
    assert.match(ex.body.stdout, /ok\n$/);
  }
  // MCP's run_command, which a server serves without re-entering its API, still reaches a machine of another host.
  const viaMcp = await request(`${a.url}/v1/mcp`, {
    method: "POST",
    headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json", accept: "application/json, text/event-stream", "mcp-protocol-version": "2025-06-18" },
    body: JSON.stringify({ jsonrpc: "2.0", id: 1, method: "tools/call", params: { name: "run_command", arguments: { machine_id: mb, command: "cat /etc/hostname; echo mcp-ok" } } }),
  });
  const mcpAnswer = (await viaMcp.body.json()) as { result?: { isError?: boolean; structuredContent?: { stdout?: string } } };
  assert.equal(viaMcp.statusCode, 200, JSON.stringify(mcpAnswer));
  assert.equal(mcpAnswer.result?.isError, undefined, JSON.stringify(mcpAnswer));
  assert.match(mcpAnswer.result?.structuredContent?.stdout ?? "", /mcp-ok\n$/);
  // Identical requests forwarded in the same moment are each their own signed forward, never taken for a replay.
  const same = await Promise.all(Array.from({ length: 8 }, () => a.call("POST", `/v1/machines/${mb}/exec`, { cmd: "true" })));
  assert.deepEqual(same.map((r) => r.status), Array(8).fill(200), JSON.stringify(same.find((r) => r.status !== 200)?.body));
  const payload = Buffer.alloc(3 * 1024 * 1024, 7);
  const put = await request(`${a.url}/v1/machines/${mb}/files?path=/tmp/big`, { method: "PUT", headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/octet-stream" }, body: payload });
  assert.equal(put.statusCode, 200, await put.body.text());
  const got = await request(`${c.url}/v1/machines/${mb}/files?path=/tmp/big`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  assert.equal(got.statusCode, 200);
  assert.ok(Buffer.from(await got.body.arrayBuffer()).equals(payload), "the file read through host c is the one written through host a");
  const ws = new WebSocket(`${a.url.replace("http", "ws")}/v1/machines/${mb}/ws`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  const frames = collectFrames(ws);
  await new Promise((resolve, reject) => ws.once("open", resolve).once("error", reject));
  frames.send({ type: "exec.start", request_id: "r1", cmd: "cat", stdin: true });
  const started = await frames.next((f) => f.type === "exec.started");
  frames.send({ type: "exec.stdin", pid: started.pid, data_base64: Buffer.from("through a peer").toString("base64"), eof: true });
  const out = await frames.next((f) => f.type === "exec.stdout");
  assert.equal(Buffer.from(out.data_base64, "base64").toString(), "through a peer");
  assert.equal((await frames.next((f) => f.type === "exec.exit")).exit_code, 0);
  ws.close();

  // Volumes live on the host that made them: their files and WebSocket answer through any server, and a machine
  // mounting one is placed on its host whichever server takes the create.
  const vol = await b.call("POST", "/v1/volumes", { name: "shared", size_mb: 16 });
  assert.equal(vol.status, 201, JSON.stringify(vol.body));
  assert.equal(vol.body.host_id, "h-b");
  const vws = new WebSocket(`${c.url.replace("http", "ws")}/v1/volumes/${vol.body.id}/ws`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  const vframes = collectFrames(vws);
  await new Promise((resolve, reject) => vws.once("open", resolve).once("error", reject));
  vframes.send({ type: "file_watch", request_id: "w1", path: "/", recursive: true });
  const watching = await vframes.next((f) => f.request_id === "w1");
  assert.equal(watching.type, "file_watch.started", JSON.stringify(watching));
  const vput = await request(`${a.url}/v1/volumes/${vol.body.id}/files?path=/from-a.txt`, { method: "PUT", headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/octet-stream" }, body: "written through a" });
  assert.equal(vput.statusCode, 200, await vput.body.text());
  await vframes.next((f) => f.type === "file_event" && f.path === "/from-a.txt");
  vws.close();
  const withVol = await create(c, { volumes: [{ volume_id: vol.body.id, path: "/data" }] });
  assert.equal(await hostOf(db.url, withVol.id), "h-b", "a machine mounting a volume is placed on the volume's host");
  const readVol = await a.call("POST", `/v1/machines/${withVol.id}/exec`, { cmd: "cat /data/from-a.txt" });
  assert.equal(readVol.body.stdout, "written through a");
  // Moving a volume: refused while a machine mounts it; once unmounted, moved through c (its host b does it) to a:
  // the record names a, its files answer from a's copy, b keeps nothing of it, and its machines go to a.
  const busy = await c.call("POST", `/v1/volumes/${vol.body.id}/move`, { host_id: "h-a" });
  assert.equal(busy.status, 409, JSON.stringify(busy.body));
  assert.equal((await a.call("DELETE", `/v1/machines/${withVol.id}`)).status, 200);
  assert.equal((await c.call("POST", `/v1/volumes/${vol.body.id}/move`, { host_id: "nope" })).status, 404);
  const moved = await c.call("POST", `/v1/volumes/${vol.body.id}/move`, { host_id: "h-a" });
  assert.equal(moved.status, 200, JSON.stringify(moved.body));
  assert.equal(moved.body.host_id, "h-a");
  assert.equal(existsSync(join(dirOf.get("h-b")!, "volumes", vol.body.id)), false, "b keeps no copy");
  const movedRead = await request(`${b.url}/v1/volumes/${vol.body.id}/files?path=/from-a.txt`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  assert.equal(await movedRead.body.text(), "written through a", "the moved volume's file, read through b");
  const onNewHost = await create(b, { volumes: [{ volume_id: vol.body.id, path: "/data" }] });
  assert.equal(await hostOf(db.url, onNewHost.id), "h-a", "a machine mounting it goes to its new host");
  assert.equal((await b.call("POST", `/v1/machines/${onNewHost.id}/exec`, { cmd: "cat /data/from-a.txt" })).body.stdout, "written through a");
  assert.equal((await b.call("DELETE", `/v1/machines/${onNewHost.id}`)).status, 200);

  // A snapshot's files stay on its machine's host: made through a, deleted through c, both served by host b.
  const snap = await a.call("POST", `/v1/machines/${mb}/snapshots`, { name: "on-b" });
  assert.equal(snap.status, 201, JSON.stringify(snap.body));
  const snapDeleted = await c.call("DELETE", `/v1/snapshots/${snap.body.id}`);
  assert.equal(snapDeleted.status, 200, JSON.stringify(snapDeleted.body));
  assert.equal(snapDeleted.body.status, "deleted");

  // A build runs on the host that took it; its record names that host, and its log stream answers through another.
  const built = await request(`${a.url}/v1/templates/build`, { method: "POST", headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" }, body: JSON.stringify({ name: "built-on-a", steps: [{ type: "run", command: "echo marker-from-a; echo travelled > /opt/from-a" }] }) });
  assert.equal(built.statusCode, 200);
  const buildText = await built.body.text();
  const buildId = /"build_id":"(bld_[a-z0-9]+)"/.exec(buildText)?.[1];
  assert.ok(buildId, `a build id in the stream: ${buildText.slice(0, 500)}`);
  const buildRec = await c.call("GET", `/v1/templates/built-on-a/builds/${buildId}`);
  assert.equal(buildRec.body.host_id, "h-a", "the build view carries host_id");
  const logs = await request(`${b.url}/v1/templates/built-on-a/builds/${buildId}/logs`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  assert.equal(logs.statusCode, 200);
  assert.match(String(logs.headers["content-type"]), /^text\/event-stream/);
  assert.match(await logs.body.text(), /marker-from-a/, "the build's log stream, read through host b");
  // artifact_availability is the cluster's knowledge: host c, which lacks the layers, still reads them available.
  assert.equal(buildRec.body.artifact_availability.status, "available", JSON.stringify(buildRec.body.artifact_availability));
  // A second template of host a, whose layer a will serve corrupted (below).
  const lying = await request(`${a.url}/v1/templates/build`, { method: "POST", headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" }, body: JSON.stringify({ name: "lying-a", steps: [{ type: "write_file", path: "/opt/lie", content: "honest\n" }] }) });
  const lyingText = await lying.body.text();
  assert.ok(lyingText.includes("event: end") && lyingText.includes('"artifact_id":"art_'), `lying-a was built: ${lyingText.slice(-500)}`);

  // The E2B layer through any server: a sandbox on host b driven through host a with the published SDK (control
  // plane, envd's process and filesystem services, a signed file URL, pause and connect, kill); its access token
  // checked by host a, whose secret is the store's.
  const e2bKey = (await a.call("POST", "/v1/keys", { name: "e2b-cluster", format: "e2b" })).body;
  const e2b = { apiKey: e2bKey.key as string, apiUrl: a.url, sandboxUrl: a.url, requestTimeoutMs: 30_000 };
  const sbx = await Sandbox.connect(mb.slice("mch_".length), e2b);
  assert.equal((await sbx.commands.run("echo through-a; cat /etc/hostname")).stdout.split("\n")[0], "through-a");
  await sbx.files.write("/tmp/e2b-through-a.txt", "e2b via a");
  assert.equal((await b.call("POST", `/v1/machines/${mb}/exec`, { cmd: "cat /tmp/e2b-through-a.txt" })).body.stdout, "e2b via a", "written on host b");
  // A signed file URL, sent to host a naming the sandbox in the Host as its domain form does (`49983-<id>.<domain>`;
  // with sandboxUrl set, the SDK's URL is the server's own address).
  const signed = new URL(await sbx.downloadUrl("/tmp/e2b-through-a.txt", { useSignatureExpiration: 60 }));
  const byUrl = await request(`${a.url}${signed.pathname}${signed.search}`, { headers: { host: `49983-${sbx.sandboxId}.kiln.test` } });
  assert.equal(await byUrl.body.text(), "e2b via a", "a signed file URL answered through host a");
  assert.equal((await Sandbox.getInfo(sbx.sandboxId, e2b)).state, "running");
  // An E2B create through any server is placed like Kiln's: three land on more than one host.
  const e2bPlaced = await Promise.all([0, 1, 2].map(() => Sandbox.create("base", { ...e2b, timeoutMs: 120_000 })));
  const e2bHosts = await Promise.all(e2bPlaced.map((x) => hostOf(db.url, `mch_${x.sandboxId}`)));
  assert.ok(new Set(e2bHosts).size >= 2, `E2B creates through one server placed on ${e2bHosts.join(", ")}`);
  // Pause and resume of a sandbox on another host than the one asked.
  const remote = e2bPlaced[e2bHosts.findIndex((h) => h !== "h-a")]!;
  await remote.pause();
  assert.equal((await Sandbox.getInfo(remote.sandboxId, e2b)).state, "paused");
  const resumed = await Sandbox.connect(remote.sandboxId, e2b);
  assert.equal((await resumed.commands.run("echo back")).stdout, "back\n");
  for (const x of e2bPlaced) await x.kill();
  for (const x of e2bPlaced) assert.equal((await a.call("GET", `/v1/machines/mch_${x.sandboxId}`)).body.status, "destroyed");
  // The deployments edge and E2B's port proxy through any server, carried by the cluster tunnel: a replica answers
  // through another host's edge (HTTP both ways, streamed, and a WebSocket echo), and a port of the sandbox on b
  // answers getHost through host a.
  const across = await b.call("POST", "/v1/agent-deployments", { template: "local/base", name: "across", command: appCommand(8080), port: 8080 });
  assert.equal(across.status, 201, JSON.stringify(across.body));
  const svc = await until("the replica to be ready", async () => {
    const list = (await a.call("GET", `/v1/agent-deployments/${across.body.id}/services`)).body.services as { status: string; public_url: string | null; machine_id: string }[];
    return list.find((x) => x.status === "ready" && x.public_url);
  }, 120_000);
  // Replicas are spread (any host may run it): the edge is asked through a server of another host.
  const owner = await hostOf(db.url, svc.machine_id);
  const via = [...servers].find(([h]) => h !== owner)![1];
  const svcUrl = new URL(svc.public_url!);
  const depUrl = new URL(across.body.edge_url);
  for (const u of [svcUrl, depUrl]) {
    // Another host learns of the owner's replicas from the store within about a second.
    const hello = await until(`${u.pathname} answered through another host`, async () => {
      const res = await request(`${via.url}${u.pathname}hello${u.search}`);
      const text = await res.body.text();
      return res.statusCode === 200 && text;
    });
    assert.equal(hello, "hello from /hello query ", "the service's own answer, the token taken off");
  }
  const upload = Buffer.alloc(3 * 1024 * 1024, 5);
  const posted = await request(`${via.url}${svcUrl.pathname}${svcUrl.search}`, { method: "POST", body: upload });
  assert.equal(await posted.body.text(), createHash("sha256").update(upload).digest("hex"), "a body streamed through another host to the replica");
  const edgeWs = new WebSocket(`${via.url.replace("http", "ws")}${svcUrl.pathname}ws${svcUrl.search}`);
  await new Promise((resolve, reject) => edgeWs.once("open", resolve).once("error", reject));
  const echoes: Buffer[] = [];
  const echoed = new Promise<void>((resolve) => edgeWs.on("message", (m: Buffer) => echoes.push(m) === 2 && resolve()));
  const wsBig = Buffer.alloc(200_000, 3);
  edgeWs.send("across hosts");
  edgeWs.send(wsBig);
  await echoed;
  assert.equal(echoes[0].toString(), "across hosts");
  assert.ok(echoes[1].equals(wsBig), "a WebSocket echo through another host's edge");
  edgeWs.close();
  assert.equal((await b.call("DELETE", `/v1/agent-deployments/${across.body.id}`)).status, 200);

  await sbx.files.write("/tmp/site/index.html", "<h1>port 8000 on b</h1>");
  const site = await sbx.commands.run("cd /tmp/site && exec python3 -m http.server 8000 --bind 127.0.0.1", { background: true });
  const traffic = { host: sbx.getHost(8000), "e2b-traffic-access-token": sbx.trafficAccessToken! };
  const page = await until("getHost(8000) answered through host a", async () => {
    const res = await request(`${a.url}/index.html`, { headers: traffic });
    const text = await res.body.text();
    return res.statusCode === 200 && text;
  });
  assert.equal(page, "<h1>port 8000 on b</h1>");
  const closedPort = await request(`${a.url}/`, { headers: { ...traffic, host: sbx.getHost(8001) } });
  assert.equal(closedPort.statusCode, 502, "a closed port on b answers as it does locally");
  await closedPort.body.dump();
  const noTraffic = await request(`${a.url}/index.html`, { headers: { host: traffic.host } });
  assert.equal(noTraffic.statusCode, 401, "the traffic token is checked by host a");
  await noTraffic.body.dump();

  // The tunnel route itself answers peers only: no cluster headers (with a key or not) and forged ones are refused;
  // a genuine signature opens a byte stream to the port, once.
  const tunnelPath = `/v1/cluster/machines/${mb}/ports/8000/tunnel?use=http`;
  assert.equal((await tunnelStatus(b.url, tunnelPath, {})).status, 401, "a stranger");
  assert.equal((await tunnelStatus(b.url, tunnelPath, { authorization: `Bearer ${TEST_KEY}` })).status, 401, "a key holder");
  const forgedTunnel = { "x-kiln-cluster-from": "h-a", "x-kiln-cluster-to": "h-b", "x-kiln-cluster-ts": String(Date.now()), "x-kiln-cluster-key": "", "x-kiln-cluster-nonce": "forged", "x-kiln-cluster-sig": "AAAA" };
  assert.equal((await tunnelStatus(b.url, tunnelPath, { ...forgedTunnel, authorization: `Bearer ${TEST_KEY}` })).status, 401, "forged cluster headers");
  const tunnelSecret = await clusterSecret(db.url);
  const ts = String(Date.now());
  const mac = createHmac("sha256", tunnelSecret);
  for (const p of ["GET", tunnelPath, ts, "t1", "", "h-a", "h-b"]) mac.update(`${p.length}:${p}\n`);
  const genuine = { "x-kiln-cluster-from": "h-a", "x-kiln-cluster-to": "h-b", "x-kiln-cluster-ts": ts, "x-kiln-cluster-key": "", "x-kiln-cluster-nonce": "t1", "x-kiln-cluster-sig": mac.digest("base64url") };
  const opened = await tunnelStatus(b.url, tunnelPath, genuine);
  assert.equal(opened.status, 101);
  opened.socket!.write("GET /index.html HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
  const overTunnel = await new Promise<string>((resolve) => {
    let text = "";
    opened.socket!.on("data", (c: Buffer) => (text += c.toString())).on("close", () => resolve(text));
  });
  assert.match(overTunnel, /^HTTP\/1\.[01] 200[\s\S]*port 8000 on b/, "bytes through the tunnel reach the machine's port");
  assert.equal((await tunnelStatus(b.url, tunnelPath, genuine)).status, 401, "a replayed tunnel signature");
  await site.kill();

  // A forged token is refused by the first server; nothing reaches host b.
  const forgedToken = await request(`${a.url}/process.Process/List`, { method: "POST", headers: { "e2b-sandbox-id": sbx.sandboxId, "x-access-token": `${e2bKey.id}.AAAA`, "content-type": "application/json" }, body: "{}" });
  assert.equal(forgedToken.statusCode, 401);
  await forgedToken.body.dump();

  // Forged cluster headers on what is forwarded now: refused before anything is served, WebSocket or not.
  const forgedHeaders = { "x-kiln-cluster-from": "h-a", "x-kiln-cluster-to": "h-b", "x-kiln-cluster-ts": String(Date.now()), "x-kiln-cluster-key": "", "x-kiln-cluster-nonce": "forged", "x-kiln-cluster-sig": "AAAA" };
  assert.equal((await raw(`${b.url}/v1/volumes/${vol.body.id}/files?path=/from-a.txt`, "GET", forgedHeaders)).status, 401);
  assert.equal((await raw(`${a.url}/v1/templates/built-on-a/builds/${buildId}/logs`, "GET", { ...forgedHeaders, "x-kiln-cluster-to": "h-a" })).status, 401);
  const forgedWs = new WebSocket(`${b.url.replace("http", "ws")}/v1/volumes/${vol.body.id}/ws`, { headers: { ...forgedHeaders, authorization: `Bearer ${TEST_KEY}` } });
  const forgedStatus = await new Promise<number>((resolve) => {
    forgedWs.once("unexpected-response", (_req, res) => resolve(res.statusCode ?? 0));
    forgedWs.once("open", () => resolve(101));
    forgedWs.once("error", () => resolve(-1));
  });
  forgedWs.terminate();
  assert.equal(forgedStatus, 401, "a forged forward of a volume WebSocket");
  assert.equal((await b.call("DELETE", `/v1/volumes/${vol.body.id}`)).status, 204);

  // The caller is authenticated by the first server: no key, or a revoked one, never reaches the owner.
  assert.equal((await raw(`${a.url}/v1/machines/${mb}/exec`, "POST", { "content-type": "application/json" }, JSON.stringify({ cmd: "true" }))).status, 401);
  const other = await a.call("POST", "/v1/keys", { name: "not-operator" });
  assert.equal((await raw(`${a.url}/v1/machines/${mb}/exec`, "POST", { authorization: `Bearer ${other.body.key}`, "content-type": "application/json" }, JSON.stringify({ cmd: "true" }))).status, 200);
  assert.equal((await a.call("DELETE", `/v1/keys/${other.body.id}`)).status, 200);
  assert.equal((await raw(`${a.url}/v1/machines/${mb}/exec`, "POST", { authorization: `Bearer ${other.body.key}`, "content-type": "application/json" }, JSON.stringify({ cmd: "true" }))).status, 401);

  // Forged cluster authentication is refused by the owner, whatever else the request carries.
  const path = `/v1/machines/${mb}/exec`;
  const body = JSON.stringify({ cmd: "id" });
  const json = { "content-type": "application/json" };
  const forged = { ...json, "x-kiln-cluster-from": "h-a", "x-kiln-cluster-to": "h-b", "x-kiln-cluster-ts": String(Date.now()), "x-kiln-cluster-key": "", "x-kiln-cluster-nonce": "forged", "x-kiln-cluster-sig": "AAAA" };
  assert.equal((await raw(b.url + path, "POST", forged, body)).status, 401, "a made-up signature");
  assert.equal((await raw(b.url + path, "POST", { ...forged, authorization: `Bearer ${TEST_KEY}` }, body)).status, 401, "a bad signature is not rescued by a good key");
  // With the real secret (what only the store holds): a signature for another host, an old one, and a replay.
  const secret = await clusterSecret(db.url);
  const keyId = await operatorKeyId(db.url);
  const sign = (to: string, ts: number) => {
    const h = createHmac("sha256", secret);
    const nonce = `n${ts}`;
    for (const p of ["POST", path, String(ts), nonce, keyId, "h-a", to]) h.update(`${p.length}:${p}\n`);
    return { ...json, "x-kiln-cluster-from": "h-a", "x-kiln-cluster-to": to, "x-kiln-cluster-ts": String(ts), "x-kiln-cluster-nonce": nonce, "x-kiln-cluster-key": keyId, "x-kiln-cluster-sig": h.digest("base64url") };
  };
  assert.equal((await raw(b.url + path, "POST", sign("h-c", Date.now()), body)).status, 401, "addressed to another host");
  assert.equal((await raw(b.url + path, "POST", sign("h-b", Date.now() - 120_000), body)).status, 401, "outside the window");
  const good = sign("h-b", Date.now());
  assert.equal((await raw(b.url + path, "POST", good, body)).status, 200, "a genuine signature works once");
  assert.equal((await raw(b.url + path, "POST", good, body)).status, 401, "and is refused when replayed");
  // Absent cluster headers: a direct request to the owner still needs its key like any request.
  assert.equal((await raw(b.url + path, "POST", json, body)).status, 401);

  // Drain: only the operator's key; a draining host gets no new machines and releases its idle warm pool; activate
  // brings both back.
  // At least its size: the pool grows with the creates a host serves (KILN_WARM_POOL_MAX=auto).
  await until("host c's warm machine to be booted", async () => (await warmReady(c)) >= 1, 120_000);
  const plain = await a.call("POST", "/v1/keys", { name: "plain" });
  assert.equal((await raw(`${a.url}/v1/hosts/h-c/drain`, "POST", { authorization: `Bearer ${plain.body.key}` })).status, 403);
  const drained = await b.call("POST", "/v1/hosts/h-c/drain");
  assert.equal(drained.status, 200);
  assert.equal(drained.body.status, "draining");
  // At once, through a, whose view of the hosts may still say c is active (and c has the warm machine placement
  // prefers): c itself refuses the placed create (503) and a places it on the next host.
  for (let i = 0; i < 2; i++) {
    const m = await create(a);
    assert.notEqual(await hostOf(db.url, m.id), "h-c", "a create placed on a host just drained goes elsewhere");
    assert.equal((await a.call("DELETE", `/v1/machines/${m.id}`)).status, 200);
  }
  // Drained through b: c sees it at its next heartbeat and releases its idle warm machine.
  await until("host c's warm pool to be released", async () => (await warmReady(c)) === 0, 30_000);
  const during: string[] = [];
  for (let i = 0; i < 3; i++) {
    const m = await create(c);
    during.push(m.id);
    assert.notEqual(await hostOf(db.url, m.id), "h-c", "nothing placed on a draining host, even through it");
  }
  for (const id of during) assert.equal((await c.call("DELETE", `/v1/machines/${id}`)).status, 200);

  // Templates travel: with a and c draining, a machine of the template built on a, created through b, runs on b: b
  // fetched the layer it lacked from a by content digest, checked it, and now holds it under the same digest.
  assert.equal((await b.call("POST", "/v1/hosts/h-a/drain")).status, 200);
  // Two creates at once share one fetch.
  const [travelled, twin] = await Promise.all([create(b, { template: "built-on-a" }), create(b, { template: "built-on-a" })]);
  assert.equal(await hostOf(db.url, travelled.id), "h-b", "placed on the only active host");
  assert.equal(await hostOf(db.url, twin.id), "h-b");
  assert.equal(b.output().split("fetched a template layer from a peer").length - 1, 1, "one fetch for both creates");
  assert.equal((await b.call("DELETE", `/v1/machines/${twin.id}`)).status, 200);
  const ran = await b.call("POST", `/v1/machines/${travelled.id}/exec`, { cmd: "cat /opt/from-a" });
  assert.equal(ran.body.stdout, "travelled\n", JSON.stringify(ran.body));
  const content = await layerContent(db.url, "built-on-a");
  const holdings = await query<{ digest: string; host_id: string; dir: string }>(db.url, "select digest, host_id, dir from layer_holders where digest = any($1)", [content]);
  for (const d of content) for (const h of ["h-a", "h-b"]) assert.ok(holdings.some((r) => r.digest === d && r.host_id === h), `${h} holds ${d}`);
  const builtLayer = content.at(-1)!;
  const fetchedDir = holdings.find((r) => r.digest === builtLayer && r.host_id === "h-b")!.dir;
  assert.ok(fetchedDir.startsWith(join(dirOf.get("h-b")!, "layers")), "the fetched layer is in b's own data dir");
  assert.equal((await b.call("DELETE", `/v1/machines/${travelled.id}`)).status, 200);

  // The layer endpoint answers peers only: an API key and a stranger get 401; a signature (the store's secret) gets
  // the tar, whose sha256 is the digest.
  const layerPath = `/v1/cluster/layers/${builtLayer}`;
  assert.equal((await raw(a.url + layerPath, "GET", { authorization: `Bearer ${TEST_KEY}` })).status, 401, "an API key cannot read a peer's layer");
  assert.equal((await raw(a.url + layerPath, "GET", {})).status, 401, "nor a stranger");
  const peerSign = (to: string) => {
    const ts = String(Date.now());
    const nonce = `layer${ts}`;
    const h = createHmac("sha256", secret);
    for (const p of ["GET", layerPath, ts, nonce, "", "h-b", to]) h.update(`${p.length}:${p}\n`);
    return { "x-kiln-cluster-from": "h-b", "x-kiln-cluster-to": to, "x-kiln-cluster-ts": ts, "x-kiln-cluster-nonce": nonce, "x-kiln-cluster-key": "", "x-kiln-cluster-sig": h.digest("base64url") };
  };
  assert.equal((await raw(a.url + layerPath, "GET", peerSign("h-c"))).status, 401, "a signature for another host");
  const tar = await request(a.url + layerPath, { headers: peerSign("h-a") });
  assert.equal(tar.statusCode, 200);
  const tarHash = createHash("sha256");
  for await (const chunk of tar.body) tarHash.update(chunk as Buffer);
  assert.equal(`sha256:${tarHash.digest("hex")}`, builtLayer, "the served tar hashes to the layer's digest");

  // A peer serving other bytes is refused: a's copy of lying-a's layer has one byte changed, and host c is recorded
  // as a holder it is not. The create through b fails naming both, and b keeps nothing of it.
  const lie = (await layerContent(db.url, "lying-a")).at(-1)!;
  const aDir = (await query<{ dir: string }>(db.url, "select dir from layer_holders where digest = $1 and host_id = 'h-a'", [lie]))[0].dir;
  await writeFile(join(aDir, "opt", "lie"), "hOnest\n");
  await query(db.url, "insert into layer_holders (digest, host_id, dir, bytes, created_at) values ($1, 'h-c', '/nowhere', 1, $2)", [lie, new Date().toISOString()]);
  const refused = await b.call("POST", "/v1/machines", { template: "lying-a" });
  assert.equal(refused.status, 503, JSON.stringify(refused.body));
  assert.match(refused.body.error, /could not be fetched/);
  assert.match(refused.body.error, /host h-a: .*does not match/, "a's corrupt bytes are named");
  assert.match(refused.body.error, /host h-c: /, "and the next holder was tried");
  assert.equal((await query(db.url, "select 1 from layer_holders where digest = $1 and host_id = 'h-b'", [lie])).length, 0, "b does not hold it");
  const bLayers = await readdir(join(dirOf.get("h-b")!, "layers"));
  assert.equal(bLayers.some((n) => n.includes(lie.slice(7)) || n.startsWith(".fetching-")), false, `nothing of it on b's disk: ${bLayers.join(" ")}`);
  await query(db.url, "delete from layer_holders where host_id = 'h-c' and digest = $1", [lie]);
  assert.equal((await b.call("POST", "/v1/hosts/h-a/activate")).status, 200);
  assert.equal((await a.call("POST", "/v1/hosts/h-c/activate")).body.status, "active");
  await until("host c's warm pool to be refilled", async () => (await warmReady(c)) >= 1, 120_000);
  // Template locality: a create of built-on-a through c goes to a host that holds its layers, not to c.
  const near = await create(c, { template: "built-on-a" });
  assert.notEqual(await hostOf(db.url, near.id), "h-c", "placed where the template's layers are");
  assert.equal((await c.call("DELETE", `/v1/machines/${near.id}`)).status, 200);

  // Deployments spread their replicas: three replicas through a run on three hosts, each made and supervised by its
  // host; the envs reach the replicas on other hosts too (sealed under a's key, opened by a, sent signed).
  // Envs cross between hosts in the signed call that asks for a replica: never in a log line or the store.
  const ENV_MARKER = `spread-env-${Date.now().toString(36)}`;
  const depBody = { template: "local/base", name: "spread", command: `echo replica-says-hi && ${appCommand(8080)}`, port: 8080, replicas: 3, envs: { GREETING: ENV_MARKER }, readiness: { path: "/health", interval_s: 0.5, timeout_s: 2 } };
  const dep = await a.call("POST", "/v1/agent-deployments", depBody);
  assert.equal(dep.status, 201, JSON.stringify(dep.body));
  const depId = dep.body.id as string;
  const readyReplicas = async (via: ServerProcess, n: number) =>
    until(`${n} ready replicas`, async () => {
      const all = (await via.call("GET", `/v1/agent-deployments/${depId}/services`)).body.services as any[];
      const ready = all.filter((s) => s.status === "ready");
      return ready.length === n && all.filter((s) => ["starting", "unhealthy"].includes(s.status)).length === 0 ? { all, ready } : undefined;
    }, 120_000);
  const first = await readyReplicas(b, 3);
  const replicaHost = new Map(await Promise.all(first.ready.map(async (s) => [s.id as string, await hostOf(db.url, s.machine_id)] as const)));
  assert.deepEqual([...replicaHost.values()].sort(), ["h-a", "h-b", "h-c"], "one replica on each host");
  const onC = first.ready.find((s) => replicaHost.get(s.id) === "h-c")!;
  const env = await b.call("POST", `/v1/machines/${onC.machine_id}/exec`, { cmd: `tr '\\0' '\\n' < /proc/${onC.process_id}/environ | grep GREETING` });
  assert.equal(env.body.stdout, `GREETING=${ENV_MARKER}\n`, JSON.stringify(env.body));
  // A replica's output and its restart through a server that does not run it: forwarded to its host (they answered
  // 409 there before: its machine is not that server's). The restart's envs reach the new process, in no record.
  const svcPath = `/v1/agent-deployments/${depId}/services/${onC.id}`;
  const replicaLogs = await b.call("GET", `${svcPath}/logs`);
  assert.equal(replicaLogs.status, 200, JSON.stringify(replicaLogs.body));
  assert.equal(replicaLogs.body.service_id, onC.id);
  assert.match(replicaLogs.body.output, /replica-says-hi/);
  const RESTART_MARKER = `restart-env-${Date.now().toString(36)}`;
  const restarted = await raw(`${b.url}${svcPath}/restart`, "POST", { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json", "idempotency-key": "across-1" }, JSON.stringify({ reason: "through b", envs: { RESTART_MARKER } }));
  assert.equal(restarted.status, 200, JSON.stringify(restarted.body));
  assert.notEqual(restarted.body.process_id, onC.process_id, "a new process");
  assert.equal(restarted.body.readiness_status.restarts.last_reason, "through b");
  const repeat = await raw(`${a.url}${svcPath}/restart`, "POST", { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json", "idempotency-key": "across-1" }, JSON.stringify({ reason: "through b" }));
  assert.equal(repeat.body.process_id, restarted.body.process_id, "the repeat, through a third server, answers the first restart");
  const restartEnv = await b.call("POST", `/v1/machines/${onC.machine_id}/exec`, { cmd: `tr '\\0' '\\n' < /proc/${restarted.body.process_id}/environ | grep RESTART_MARKER` });
  assert.equal(restartEnv.body.stdout, `RESTART_MARKER=${RESTART_MARKER}\n`, JSON.stringify(restartEnv.body));
  assert.equal((await raw(`${c.url}${svcPath}/logs`, "GET", {})).status, 401, "the first server checks the caller");
  await readyReplicas(a, 3);
  onC.process_id = restarted.body.process_id;

  const mc = on("h-c");
  // Its sandbox's traffic token, to reach one of its ports through a survivor once it is lost (below).
  const mcTraffic = { host: `8000-${mc.slice("mch_".length)}.kiln.test`, "e2b-traffic-access-token": (await Sandbox.connect(mc.slice("mch_".length), e2b)).trafficAccessToken! };
  // A volume of c being moved to b when c is killed (wherever the move is then): after c restarts, one host holds it
  // whole and the record names that one; the other keeps no copy.
  const vol2 = await c.call("POST", "/v1/volumes", { name: "moving", size_mb: 16 });
  assert.equal(vol2.body.host_id, "h-c");
  const v2put = await request(`${a.url}/v1/volumes/${vol2.body.id}/files?path=/kept.txt`, { method: "PUT", headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/octet-stream" }, body: "kept whole" });
  assert.equal(v2put.statusCode, 200, await v2put.body.text());
  const midMove = a.call("POST", `/v1/volumes/${vol2.body.id}/move`, { host_id: "h-b" }).catch(() => undefined);

  // A host killed with SIGKILL: lost within the bound, its machine failed with the reason, its webhook once.
  await new Promise((r) => setTimeout(r, 30));
  const killedAt = Date.now();
  c.child.kill("SIGKILL");
  await c.exited;
  servers.delete("h-c");
  const lost = await until("host h-c to be marked lost", async () => {
    const h = (await a.call("GET", "/v1/hosts/h-c")).body;
    return h.status === "lost" ? h : undefined;
  }, (LOST_AFTER_S + 20) * 1000);
  // Marking the host and failing its machines are two steps of one sweep: the machine follows within moments.
  const failed = await until("the lost host's machine to be failed", async () => {
    const m = (await b.call("GET", `/v1/machines/${mc}`)).body;
    return m.status === "failed" ? m : undefined;
  }, 20_000);
  const failedAfterMs = Date.now() - killedAt;
  assert.ok(failedAfterMs < (LOST_AFTER_S + 10) * 1000, `its machine failed ${failedAfterMs} ms after the kill`);
  assert.match(failed.failure_reason, /host name-h-c \(h-c\) was lost/);
  assert.ok(lost.lost_at);
  const delivery = await rx.waitFor((r) => r.path === "/lost" && JSON.parse(r.body).machine?.id === mc, 30_000);
  assert.equal(JSON.parse(delivery.body).machine.status, "failed");
  // Several more heartbeats of both survivors later, still exactly one delivery for it.
  await new Promise((r) => setTimeout(r, HEARTBEAT_MS * 6));
  assert.equal(rx.received.filter((r) => r.path === "/lost" && JSON.parse(r.body).machine?.id === mc).length, 1, "the lost machine's webhook is delivered once");
  // The others are unaffected, and answer through either survivor.
  for (const [h, via] of [["h-a", b], ["h-b", a]] as const) {
    const ex = await via.call("POST", `/v1/machines/${on(h)}/exec`, { cmd: "echo alive" });
    assert.equal(ex.body.stdout, "alive\n");
  }
  // A port of a machine on the lost host answers through a survivor as the local path does for a stopped machine.
  const lostPort = await request(`${a.url}/`, { headers: mcTraffic });
  const lostBody = await lostPort.body.text();
  assert.equal(lostPort.statusCode, 409, lostBody);
  assert.match(lostBody, new RegExp(`Machine ${mc} is failed`));
  // The deployment's replica on the lost host is failed, saying why, once (one event across both survivors), and a
  // replacement runs on a surviving host; its readiness_status names the replica it replaces.
  const gone = await until("the lost host's replica to be failed", async () => {
    const s = (await a.call("GET", `/v1/agent-deployments/${depId}/services/${onC.id}`)).body;
    return s.status === "failed" ? s : undefined;
  }, 20_000);
  const again = await readyReplicas(a, 3);
  assert.match(gone.failure_reason, /host name-h-c \(h-c\) was lost/);
  const replacement = again.ready.find((s) => !replicaHost.has(s.id))!;
  assert.deepEqual(replacement.readiness_status.rescheduled.replaces, [onC.id]);
  assert.notEqual(await hostOf(db.url, replacement.machine_id), "h-c");
  assert.equal((await query(db.url, "select id from events where operation = 'service.failed' and machine_id = $1", [onC.machine_id])).length, 1, "the lost replica's failure is recorded once");
  assert.equal((await a.call("GET", `/v1/agent-deployments/${depId}`)).body.rollout_status, "idle");

  // Creates skip the lost host.
  const afterLoss = await create(a);
  assert.notEqual(await hostOf(db.url, afterLoss.id), "h-c");
  assert.equal((await a.call("DELETE", `/v1/machines/${afterLoss.id}`)).status, 200);

  // The lost host comes back: active again, and the container of its failed machine is gone.
  const machineDir = join(cDir, "machines", mc);
  const { s: c2 } = await start("h-c", cDir);
  assert.equal((await a.call("GET", "/v1/hosts/h-c")).body.status, "active");
  assert.equal((await c2.call("GET", `/v1/machines/${mc}`)).body.status, "failed", "a failed record stays failed");
  assert.equal(existsSync(machineDir), false, "nothing of the failed machine is left on its host");
  assert.equal(existsSync(join(cDir, "oci-state", TEST_RUNTIME, mc)), false, "no runtime state left for it");
  await midMove;
  const v2host = (await query<{ host_id: string }>(db.url, "select host_id from volumes where id = $1", [vol2.body.id]))[0].host_id;
  assert.ok(v2host === "h-b" || v2host === "h-c", v2host);
  for (const h of ["h-b", "h-c"]) {
    const vdir = join(dirOf.get(h)!, "volumes");
    assert.equal(existsSync(join(vdir, vol2.body.id, "image.ext4")), h === v2host, `${h} holds the image only if it is its host (${v2host})`);
    assert.deepEqual((existsSync(vdir) ? await readdir(vdir) : []).filter((n) => n.startsWith(".incoming-")), [], `no partial copy on ${h}`);
  }
  const kept = await request(`${a.url}/v1/volumes/${vol2.body.id}/files?path=/kept.txt`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  assert.equal(await kept.body.text(), "kept whole", `read from ${v2host}`);
  assert.equal((await a.call("DELETE", `/v1/volumes/${vol2.body.id}`)).status, 204);
  // Its old replica is not revived: the deployment still has three, none on c (a few heartbeats later).
  await new Promise((r) => setTimeout(r, HEARTBEAT_MS * 4));
  const settled = (await c2.call("GET", `/v1/agent-deployments/${depId}/services`)).body.services as any[];
  assert.equal(settled.filter((s) => s.status === "ready").length, 3, JSON.stringify(settled.map((s) => [s.id, s.status])));
  assert.equal(existsSync(join(cDir, "machines", onC.machine_id)), false, "the lost replica's machine is gone from c");

  // A rollout whose server is killed (SIGKILL) mid-way resumes when that server starts again, though none of the
  // deployment's replicas runs there: c (drained, so its rollout places the new replicas on a and b) takes a PATCH
  // with new envs (sealed under c's key) and is killed once the rollout's first new replica exists.
  assert.equal((await a.call("POST", "/v1/hosts/h-c/drain")).status, 200);
  const ENV_MARKER2 = `resume-env-${Date.now().toString(36)}`;
  const patched = await c2.call("PATCH", `/v1/agent-deployments/${depId}`, { envs: { GREETING: ENV_MARKER2 } });
  assert.equal(patched.status, 200, JSON.stringify(patched.body));
  const v2 = patched.body.current_version_id as string;
  await until("the rollout's first new replica", async () => (await query(db.url, "select id from services where deployment_id = $1 and version_id = $2", [depId, v2])).length > 0, 60_000);
  c2.child.kill("SIGKILL");
  await c2.exited;
  servers.delete("h-c");
  assert.equal((await query<{ rollout_status: string }>(db.url, "select rollout_status from deployments where id = $1", [depId]))[0].rollout_status, "rolling");
  const { s: c3 } = await start("h-c", cDir);
  const rolledOn = await until("the resumed rollout to finish", async () => {
    const d = (await a.call("GET", `/v1/agent-deployments/${depId}`)).body;
    if (d.rollout_status !== "idle") return undefined;
    const all = (await a.call("GET", `/v1/agent-deployments/${depId}/services`)).body.services as any[];
    // The replica made before the kill may still be starting when the rollout ends: wait for it too.
    return all.some((x) => ["starting", "unhealthy"].includes(x.status)) ? undefined : { d, all };
  }, 180_000);
  const live = rolledOn.all.filter((x) => ["starting", "ready", "unhealthy"].includes(x.status));
  assert.equal(live.length, 3, JSON.stringify(rolledOn.all.map((x) => [x.id, x.status, x.version_id])));
  assert.ok(live.every((x) => x.version_id === v2 && x.status === "ready"), JSON.stringify(live.map((x) => [x.id, x.status, x.version_id])));
  // (Where the new ones run is placement's business: c may be active again by now, if it was marked lost meanwhile.)
  for (const x of live) {
    const e = await b.call("POST", `/v1/machines/${x.machine_id}/exec`, { cmd: `tr '\\0' '\\n' < /proc/${x.process_id}/environ | grep GREETING` });
    assert.equal(e.body.stdout, `GREETING=${ENV_MARKER2}\n`, JSON.stringify(e.body));
  }
  assert.equal((await a.call("POST", "/v1/hosts/h-c/activate")).status, 200);
  // Deleted through c: the replicas on a and b are stopped by their own hosts, their machines destroyed.
  assert.equal((await c3.call("DELETE", `/v1/agent-deployments/${depId}`)).body.status, "deleted");
  const after = (await a.call("GET", `/v1/agent-deployments/${depId}/services`)).body.services as any[];
  for (const s of after.filter((x) => x.id !== onC.id)) {
    assert.equal(s.status, "stopped", s.id);
    assert.equal((await a.call("GET", `/v1/machines/${s.machine_id}`)).body.status, "destroyed");
  }

  for (const p of placed) if (p.host !== "h-c") assert.equal((await a.call("DELETE", `/v1/machines/${p.id}`)).status, 200);

  // The cluster secret lives in the store only: not in any server's log, nor in any data dir.
  const marker = secret.toString("base64url");
  for (const [id, s] of [...servers, ["h-c (killed)", c] as const]) {
    assert.equal(s.output().includes(marker), false, `the secret is not in ${id}'s log`);
    assert.equal(s.output().includes(ENV_MARKER), false, `the deployment's env is not in ${id}'s log`);
    assert.equal(s.output().includes(RESTART_MARKER), false, `a restart's env is not in ${id}'s log`);
    assert.equal(s.output().includes(ENV_MARKER2), false, `the resumed rollout's env is not in ${id}'s log`);
  }
  const stored = await query<{ n: string }>(db.url, "select count(*) as n from deployment_versions where envs_sealed like $1", [`%${ENV_MARKER}%`]);
  assert.equal(Number(stored[0].n), 0, "the version's envs are sealed in the store");
  for (const d of dirs) {
    // The store's files, keys and logs; not machine disk images and pools (large, and machines never see the store).
    const found = spawnSync("sh", ["-c", 'find "$1" -xdev -type f -size -64M ! -name "*.img" ! -name "*.xfs" -print0 | xargs -0r grep -lF --binary-files=text -e "$2"', "sh", d, marker], { encoding: "utf8" });
    assert.equal(found.stdout.trim(), "", `the secret is in no file of ${d}`);
    const envFound = spawnSync("sh", ["-c", 'find "$1" -xdev -type f -size -64M ! -name "*.img" ! -name "*.xfs" -print0 | xargs -0r grep -lF --binary-files=text -e "$2"', "sh", d, ENV_MARKER], { encoding: "utf8" });
    assert.equal(envFound.stdout.trim(), "", `the deployment's env is in no file of ${d}`);
  }
});

test("a machine's tunnels from other hosts are bounded: past its share one is refused, and an idle http tunnel is closed", async () => {
  // The owner's side of the tunnel on a real machine's port, with a share and an idle bound small enough to reach.
  const k = await startTestKiln({ captureLogs: false });
  cleanups.push(() => k.close());
  const m = await k.kiln.services.machines.create({ internet: false });
  const exec = await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd: "(nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &)" } });
  assert.equal(exec.status, 200, exec.text);
  const { agent } = await k.kiln.services.machines.agentOf(m.id);
  await until("the port to listen", async () => agent.connectPort(8000).then((s) => (s.destroy(), true), () => false));
  const limits = { ...DEFAULT_PROXY_LIMITS, connections: 2, upgrades: 1, idleTimeoutMs: 300 };
  const cap = limits.connections + limits.upgrades;
  const tunnels = createTunnelServer({ machines: k.kiln.services.machines, limits });
  // The peer's connection as the owner's server holds it (`peer`) and as the first server does (`near`).
  const link = await new Promise<{ pair(): Promise<{ peer: Socket; near: Socket }>; close(): void }>((resolve) => {
    const accepted: ((s: Socket) => void)[] = [];
    const server = createTcpServer((s) => accepted.shift()!(s)).listen(0, "127.0.0.1", () => {
      const port = (server.address() as { port: number }).port;
      resolve({
        async pair() {
          const peer = new Promise<Socket>((r) => accepted.push(r));
          const near = connectTcp(port, "127.0.0.1");
          await new Promise((r) => near.once("connect", r));
          return { peer: await peer, near };
        },
        close: () => server.close(),
      });
    });
  });
  cleanups.push(async () => link.close());
  // A socket's end, whether it ended cleanly or was reset (dropping a tunnel with bytes unread resets it).
  const closed = (s: Socket) => new Promise<void>((resolve) => (s.destroyed ? resolve() : s.once("close", () => resolve())));
  const open = async (use: "http" | "pipe") => {
    const target = await tunnels.connect(m.id, 8000);
    const { peer, near } = await link.pair();
    tunnels.splice(m.id, use, peer, Buffer.alloc(0), target);
    near.resume(); // the 101, and whatever the port sends: read, so its end is seen
    return { peer, near };
  };

  // The share: `cap` tunnels open, the next refused (retryable, nothing counted), one closed makes room again.
  const held = [];
  for (let i = 0; i < cap; i++) held.push(await open("pipe"));
  assert.equal(tunnels.count(m.id), cap);
  await assert.rejects(tunnels.connect(m.id, 8000), (err: any) => err.code === "unavailable" && err.detail?.retryable === true && err.message.includes(`${cap} tunnels open`));
  assert.equal(tunnels.count(m.id), cap, "a refused tunnel takes no place");
  const peerGone = closed(held[0].peer);
  held[0].near.destroy();
  await peerGone;
  assert.equal(tunnels.count(m.id), cap - 1, "a closed tunnel gives its place back");
  held[0] = await open("pipe");
  assert.equal(tunnels.count(m.id), cap);
  await assert.rejects(tunnels.connect(m.id, 8000), /tunnels open/);
  for (const h of held) {
    const gone = closed(h.peer);
    h.near.destroy();
    await gone;
  }
  assert.equal(tunnels.count(m.id), 0);
  // A closed port refuses without taking a place either.
  await assert.rejects(tunnels.connect(m.id, 8001), (err: any) => err.code === "unavailable");
  assert.equal(tunnels.count(m.id), 0);

  // The idle bound: a silent http tunnel (the first server's kept-alive connection nobody uses) is closed by the
  // owner at its bound, both ends; a pipe tunnel (a WebSocket's) as silent stays open, watched by TCP keepalive.
  const pipe = await open("pipe");
  const http = await open("http");
  const quietFrom = Date.now();
  await Promise.all([closed(http.peer), closed(http.near)]);
  assert.ok(Date.now() - quietFrom >= limits.idleTimeoutMs - 20, "closed for its silence, not before its bound");
  assert.equal(tunnels.count(m.id), 1, "the idle tunnel's place is given back");
  assert.ok(!pipe.peer.destroyed && !pipe.near.destroyed, "a quiet pipe tunnel stays open");
  const pipeGone = closed(pipe.peer);
  pipe.near.destroy();
  await pipeGone;
  assert.equal(tunnels.count(m.id), 0);
  tunnels.close();
});

/** Sends a cluster tunnel upgrade; its status (101: the socket, the caller's to close) or the refusal's. */
function tunnelStatus(base: string, path: string, headers: Record<string, string>): Promise<{ status: number; socket?: import("node:net").Socket }> {
  return new Promise((resolve, reject) => {
    const url = new URL(base);
    // A connection of its own: a refused upgrade's connection is closed by the server, never reused.
    const req = httpRequest({ host: url.hostname, port: url.port, path, agent: false, headers: { connection: "Upgrade", upgrade: "kiln-tunnel", ...headers } });
    req.on("upgrade", (res, socket) => resolve({ status: res.statusCode ?? 0, socket }));
    req.on("response", (res) => {
      res.resume();
      resolve({ status: res.statusCode ?? 0 });
    });
    req.on("error", reject);
    req.end();
  });
}

/** Warm machines a server holds ready now (its Prometheus metrics). */
async function warmReady(s: ServerProcess): Promise<number> {
  const res = await request(`${s.url}/metrics`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  const m = /^kiln_warm_pool_ready\s+(\d+)/m.exec(await res.body.text());
  return m ? Number(m[1]) : -1;
}

/** The content digests of a template's default artifact's layers, lowest first. */
async function layerContent(url: string, name: string): Promise<string[]> {
  const rows = await query<{ config_json: string }>(url, "select a.config_json from artifacts a join templates t on t.id = a.template_id where t.name = $1 order by a.created_at desc limit 1", [name]);
  // The base template's layer (made by every host itself) is null: only the built layers travel.
  return (JSON.parse(rows[0].config_json).layerContent as (string | null)[]).filter((d): d is string => d !== null);
}

async function hostOf(url: string, machineId: string): Promise<string> {
  return (await query<{ host_id: string }>(url, "select host_id from machines where id = $1", [machineId]))[0].host_id;
}

async function clusterSecret(url: string): Promise<Buffer> {
  return Buffer.from((await query<{ secret: string }>(url, "select secret from cluster_secrets where name = 'forward'"))[0].secret, "base64url");
}

async function operatorKeyId(url: string): Promise<string> {
  return (await query<{ id: string }>(url, "select id from api_keys where revoked_at is null order by created_at limit 1"))[0].id;
}
