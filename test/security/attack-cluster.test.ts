// Attacks on what the multi-host layer added (docs/hosts.md), with two real servers on one real PostgreSQL and no
// machines: a captured forwarded request replayed after its target restarts, E2B's volume content API for a volume
// another host holds, asked through a server that does not hold it, and drain/activate with a lesser key through a
// server that is not the drained host.

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
