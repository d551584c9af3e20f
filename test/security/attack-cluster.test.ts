// Attacks on what the multi-host layer added (docs/hosts.md), with two real servers on one real PostgreSQL and no
// machines: a captured forwarded request replayed after its target restarts, E2B's volume content API for a volume
// another host holds, asked through a server that does not hold it, and drain/activate with a lesser key through a
// server that is not the drained host; E2B template upload links re-aimed (host, template, hash, expiry) or forged, and
// a burst of requested builds through both servers against the per-key bound.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createHmac } from "node:crypto";
import { existsSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import pg from "pg";
import { request } from "undici";
import { startPostgres } from "../support/postgres.ts";
import type { TestPostgres } from "../support/postgres.ts";
import { TEST_KEY } from "../support/kiln.ts";
import { startServerProcess } from "../webhooks/server-process.ts";
import type { ServerProcess } from "../webhooks/server-process.ts";

let db: TestPostgres;
const dirs: Record<string, string> = {};
const servers: Record<string, ServerProcess> = {};

async function start(id: string) {
  dirs[id] ??= await mkdtemp(join(tmpdir(), `kiln-atk-${id}-`));
  servers[id] = await startServerProcess(dirs[id], { KILN_DATABASE_URL: db.url, KILN_HOST_ID: id, KILN_LOG_LEVEL: "info" });
  return servers[id];
}

before(async () => {
  db = await startPostgres();
  await start("h-a");
  await start("h-b");
});
after(async () => {
  const b = servers["h-b"];
  const vols = b ? ((await b.call("GET", "/v1/volumes").catch(() => undefined))?.body?.volumes ?? []) : [];
  for (const v of vols as { id: string }[]) await b.call("DELETE", `/v1/volumes/${v.id}`).catch(() => undefined);
  for (const s of Object.values(servers)) await s.stop();
  await db?.stop();
  for (const d of Object.values(dirs)) await rm(d, { recursive: true, force: true });
});

async function raw(url: string, method: string, headers: Record<string, string>, body?: string) {
  const res = await request(url, { method: method as "GET", headers, body });
  const text = await res.body.text();
  return { status: res.statusCode, text };
}

async function query<T>(sql: string): Promise<T[]> {
  const client = new pg.Client({ connectionString: db.url });
  await client.connect();
  try {
    return (await client.query(sql)).rows as T[];
  } finally {
    await client.end();
  }
}

test("a forwarded request captured on the wire is refused when replayed after its target restarted", async () => {
  const b = servers["h-b"];
  const vol = await b.call("POST", "/v1/volumes", { name: "replayed", size_mb: 16 });
  assert.equal(vol.status, 201);
  const path = `/v1/volumes/${vol.body.id}/files?path=/f`;
  const put = (headers: Record<string, string>, body: string) => raw(servers["h-b"].url + path, "PUT", { "content-type": "application/octet-stream", ...headers }, body);
  // What host a would send for the operator (as an on-path observer of the hosts' plain HTTP sees it).
  const secret = Buffer.from((await query<{ secret: string }>("select secret from cluster_secrets where name = 'forward'"))[0].secret, "base64url");
  const keyId = (await query<{ id: string }>("select id from api_keys where revoked_at is null order by created_at limit 1"))[0].id;
  const ts = String(Date.now());
  const nonce = "captured-nonce";
  const h = createHmac("sha256", secret);
  for (const p of ["PUT", path, ts, nonce, keyId, "h-a", "h-b"]) h.update(`${p.length}:${p}\n`);
  const captured = { "x-kiln-cluster-from": "h-a", "x-kiln-cluster-to": "h-b", "x-kiln-cluster-ts": ts, "x-kiln-cluster-nonce": nonce, "x-kiln-cluster-key": keyId, "x-kiln-cluster-sig": h.digest("base64url") };
  assert.equal((await put(captured, "captured")).status, 200, "the genuine request");
  assert.equal((await put(captured, "captured")).status, 401, "replayed at once");
  assert.equal((await put({ authorization: `Bearer ${TEST_KEY}` }, "newer")).status, 200);
  await b.stop();
  const restarted = await start("h-b");
  const replay = await put(captured, "captured");
  assert.equal(replay.status, 401, `replayed after the restart (${Date.now() - Number(ts)} ms after signing): ${replay.text}`);
  assert.match(replay.text, /predates/, "refused as older than the restart, not merely as stale");
  const now = await raw(restarted.url + path, "GET", { authorization: `Bearer ${TEST_KEY}` });
  assert.equal(now.text, "newer", "the replay changed nothing");
});

test("E2B's volume content API for a volume another host holds, through a server that does not hold it", async () => {
  const [a, b] = [servers["h-a"], servers["h-b"]];
  const made = await raw(`${b.url}/volumes`, "POST", { "x-api-key": TEST_KEY, "content-type": "application/json" }, JSON.stringify({ name: "held-by-b" }));
  assert.equal(made.status, 201, made.text);
  const volumeId = JSON.parse(made.text).volumeID as string;
  // Server a hands out a token for b's volume (E2B's control plane answers on any server).
  const info = await raw(`${a.url}/volumes/${volumeId}`, "GET", { "x-api-key": TEST_KEY });
  assert.equal(info.status, 200, info.text);
  const tokenFromA = JSON.parse(info.text).token as string;
  const bearer = { authorization: `Bearer ${tokenFromA}` };
  const put = await raw(`${a.url}/volumecontent/${volumeId}/file?path=/through-a.txt`, "PUT", { ...bearer, "content-type": "application/octet-stream" }, "via a");
  const read = await raw(`${a.url}/volumecontent/${volumeId}/file?path=/through-a.txt`, "GET", bearer);
  // Forwarded to b (the volume's host), after a checked the token: served from b's volume, never a 500.
  assert.equal(put.status, 201, `through a: PUT ${put.status} ${put.text}`);
  assert.equal(read.status, 200, read.text);
  assert.equal(read.text, "via a", "served from the volume b holds");
  // On its own host the volume's content API answers (with that server's token).
  const tokenFromB = JSON.parse((await raw(`${b.url}/volumes/${volumeId}`, "GET", { "x-api-key": TEST_KEY })).text).token as string;
  assert.equal((await raw(`${b.url}/volumecontent/${volumeId}/path?path=/`, "GET", { authorization: `Bearer ${tokenFromB}` })).status, 200);
  assert.equal(existsSync(join(dirs["h-a"], "volumes", volumeId)), false, "server a made nothing for a volume it does not hold");
});

test("a lesser key drains and activates no host, through any server", async () => {
  const [a, b] = [servers["h-a"], servers["h-b"]];
  const made = await a.call("POST", "/v1/keys", { name: "lesser" });
  const lesser = { authorization: `Bearer ${made.body.key}` };
  for (const via of [a, b]) {
    for (const action of ["drain", "activate"]) {
      for (const host of ["h-a", "h-b"]) {
        const r = await raw(`${via.url}/v1/hosts/${host}/${action}`, "POST", lesser);
        assert.equal(r.status, 403, `${action} ${host} through ${via.url}: ${r.text}`);
      }
    }
  }
  const hosts = (await a.call("GET", "/v1/hosts")).body.hosts as { id: string; status: string }[];
  assert.deepEqual(hosts.map((h) => h.status), ["active", "active"]);
});

test("E2B template uploads: a link re-aimed at another host, template or hash, or forged by a stranger, is refused before it is forwarded", async () => {
  const [a, b] = [servers["h-a"], servers["h-b"]];
  const key = { "x-api-key": TEST_KEY, "content-type": "application/json" };
  const made = await raw(`${a.url}/v3/templates`, "POST", key, JSON.stringify({ name: "aimed" }));
  assert.equal(made.status, 202, made.text);
  const { templateID } = JSON.parse(made.text) as { templateID: string };
  const other = JSON.parse((await raw(`${a.url}/v3/templates`, "POST", key, JSON.stringify({ name: "aimed-other" }))).text) as { templateID: string };
  const hash = "a".repeat(64);
  // Uploads go through b, which forwards them to a: b's forwarded PUTs (an earlier test's forwarding, logged late by a's
  // buffered log, is a's and not a PUT of b's).
  const forwardedLines = () => b.output().split("\n").filter((l) => l.includes("request forwarded") && l.includes('"method":"PUT"')).length;
  /** The forwarding server logs its line once the answer is through: waits for the count to reach `n`. */
  const forwardedReach = async (n: number) => {
    for (const deadline = Date.now() + 10_000; forwardedLines() < n && Date.now() < deadline; ) await new Promise((r) => setTimeout(r, 20));
    return forwardedLines();
  };
  const forwardedBefore = forwardedLines();
  // Asked through b, the link is minted by a (the template's requested builds build there) and names it.
  const link = await raw(`${b.url}/templates/${templateID}/files/${hash}`, "GET", key);
  assert.equal(link.status, 200, link.text);
  const url = new URL(JSON.parse(link.text).url as string);
  assert.equal(url.searchParams.get("host"), "h-a");
  const put = (u: URL | string, headers: Record<string, string> = {}) => raw(String(u), "PUT", headers, "not a tar, and never unpacked");
  const variant = (edit: (u: URL) => void) => {
    const u = new URL(url.pathname + url.search, b.url);
    edit(u);
    return u;
  };
  const refusals: [string, URL][] = [
    ["host re-aimed at b", variant((u) => u.searchParams.set("host", "h-b"))],
    ["host re-aimed at an unknown id", variant((u) => u.searchParams.set("host", "h-zzz"))],
    ["host dropped", variant((u) => u.searchParams.delete("host"))],
    ["another template", variant((u) => (u.pathname = `/e2b-template-files/${other.templateID}/${hash}`))],
    ["another hash", variant((u) => (u.pathname = `/e2b-template-files/${templateID}/${"b".repeat(64)}`))],
    ["a later expiry", variant((u) => u.searchParams.set("expires", String(Number(u.searchParams.get("expires")) + 3600)))],
    ["no signature (a stranger naming a host)", new URL(`${b.url}/e2b-template-files/${templateID}/${hash}?key=key_x&expires=9999999999&host=h-a`)],
  ];
  for (const [what, u] of refusals) {
    const r = await put(u);
    assert.equal(r.status, 401, `${what}: ${r.status} ${r.text}`);
  }
  // The link as minted works through either server (b forwards it to a, which keeps the upload); its forwarding is
  // the only one logged since the refusals (each of theirs would have been logged before it).
  assert.equal((await put(variant(() => undefined))).status, 200);
  assert.equal(await forwardedReach(forwardedBefore + 1), forwardedBefore + 1, "a refused upload was never sent to a peer");
  assert.equal(existsSync(join(dirs["h-a"], "e2b-template-files", hash)), true);
  assert.equal(existsSync(join(dirs["h-b"], "e2b-template-files", hash)), false);
});

test("E2B template uploads: a link dies with its key, through either server", async () => {
  const [a, b] = [servers["h-a"], servers["h-b"]];
  const made = await a.call("POST", "/v1/keys", { name: "uploader", format: "e2b" });
  assert.equal(made.status, 201);
  const key = { "x-api-key": made.body.key as string, "content-type": "application/json" };
  const { templateID } = JSON.parse((await raw(`${a.url}/v3/templates`, "POST", key, JSON.stringify({ name: "revoked-uploader" }))).text) as { templateID: string };
  const link = new URL(JSON.parse((await raw(`${a.url}/templates/${templateID}/files/${"c".repeat(64)}`, "GET", key)).text).url as string);
  assert.equal((await a.call("DELETE", `/v1/keys/${made.body.id}`)).status, 200);
  for (const via of [a, b]) {
    const r = await raw(new URL(link.pathname + link.search, via.url).toString(), "PUT", {}, "after revocation");
    assert.equal(r.status, 401, `through ${via.url}: ${r.status} ${r.text}`);
  }
  assert.equal(existsSync(join(dirs["h-a"], "e2b-template-files", "c".repeat(64))), false);
});

test("E2B requested builds sent all at once through two servers on PostgreSQL are held to the key's share (no check-then-insert race)", async () => {
  const [a, b] = [servers["h-a"], servers["h-b"]];
  const made = await a.call("POST", "/v1/keys", { name: "burst", format: "e2b" });
  assert.equal(made.status, 201);
  const headers = { "x-api-key": made.body.key as string, "content-type": "application/json" };
  const answers = await Promise.all(Array.from({ length: 160 }, (_, i) => raw(`${(i % 2 ? a : b).url}/v3/templates`, "POST", headers, JSON.stringify({ name: `burst-${i}` }))));
  assert.ok(answers.every((r) => r.status === 202 || r.status === 503), answers.map((r) => `${r.status} ${r.text}`).join("\n"));
  const [{ n }] = await query<{ n: string }>(`SELECT count(*) AS n FROM e2b_build_requests WHERE key_id = '${made.body.id}'`);
  assert.ok(Number(n) <= 100, `${n} requested builds are pending for one key (its share is 100)`);
  assert.equal(answers.filter((r) => r.status === 202).length, Number(n));
  assert.ok(Number(n) >= 1);
});
