// Webhooks across server processes: a server killed with SIGKILL mid-delivery delivers the same event after it
// restarts, and two servers on one PostgreSQL deliver each event exactly once while neither touches the other's machines.

import { test, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { startReceiver } from "./receiver.ts";
import type { Receiver } from "./receiver.ts";
import { createMachine, startServerProcess } from "./server-process.ts";
import type { ServerProcess } from "./server-process.ts";
import { startPostgres } from "../support/postgres.ts";
import { TEST_RUNTIME } from "../support/paths.ts";
import { createOciDriver } from "../../src/runtime/oci/driver.ts";
import { createLogger } from "../../src/log.ts";
import { openStore } from "../../src/store/db.ts";
import { newId } from "../../src/store/ids.ts";
import { enqueueDeliveries } from "../../src/webhooks/outbox.ts";

const cleanups: (() => Promise<unknown>)[] = [];
after(async () => {
  for (const fn of cleanups.reverse()) await fn().catch(() => undefined);
});

/** A data dir, removed at the end with whatever machines a failed test left running in it (their mounts, cgroups too). */
async function tempDir(prefix: string): Promise<string> {
  const dir = await mkdtemp(join(tmpdir(), prefix));
  cleanups.push(async () => {
    const driver = createOciDriver({ dataDir: dir, runtime: TEST_RUNTIME, hostAccess: false, log: createLogger({ level: "silent", pretty: false }), guestRuntimeDir: "" });
    for (const m of await driver.listLive().catch(() => [])) await driver.destroy(m.id).catch(() => undefined);
    await rm(dir, { recursive: true, force: true });
  });
  return dir;
}

function track(server: ServerProcess): ServerProcess {
  cleanups.push(() => server.stop());
  return server;
}

async function receiver(): Promise<Receiver> {
  const rx = await startReceiver();
  cleanups.push(() => rx.close());
  return rx;
}

async function waitForStatus(server: ServerProcess, hookId: string, deliveryId: string, status: string) {
  for (let i = 0; i < 400; i++) {
    const d = await server.call("GET", `/v1/lifecycle/webhooks/${hookId}/deliveries/${deliveryId}`);
    if (d.body?.status === status) return d.body;
    await new Promise((r) => setTimeout(r, 25));
  }
  assert.fail(`delivery ${deliveryId} never became ${status}`);
}

test("a server killed with SIGKILL mid-delivery delivers the same event after it restarts", async () => {
  const rx = await receiver();
  const dataDir = await tempDir("kiln-wh-kill-");
  const env = { KILN_WEBHOOK_ALLOW_PRIVATE: "1" };
  let killed = false;
  // The first attempt is held open: the server is killed while it waits for the answer.
  rx.respond = () => (killed ? { status: 200, body: "ok" } : new Promise(() => undefined));
  const first = track(await startServerProcess(dataDir, env));
  const hook = await first.call("POST", "/v1/lifecycle/webhooks", { url: `${rx.url}/hook`, operations: ["update"] });
  assert.equal(hook.status, 201);
  const machine = await createMachine(first);
  assert.equal((await first.call("PATCH", `/v1/machines/${machine}`, { name: "before-kill" })).status, 200);
  const sent = await rx.waitFor(() => true);
  first.child.kill("SIGKILL");
  assert.equal((await first.exited).signal, "SIGKILL");
  killed = true;

  const second = track(await startServerProcess(dataDir, env));
  const again = await rx.waitForCount(() => true, 2);
  assert.equal(again[1].headers["x-service-event-id"], sent.headers["x-service-event-id"], "the same event, at least once");
  assert.equal(again[1].headers["x-service-delivery-id"], sent.headers["x-service-delivery-id"]);
  const d = await waitForStatus(second, hook.body.id, String(sent.headers["x-service-delivery-id"]), "succeeded");
  assert.equal(d.attempts.length, 2);
  assert.match(d.attempts[0].error, /interrupted/);
  assert.equal(d.attempts[1].status_code, 200);
  // The machine outlived the kill and was adopted by the restarted server (same data dir, same host).
  assert.equal((await second.call("GET", `/v1/machines/${machine}`)).body.status, "running");
  assert.equal((await second.call("DELETE", `/v1/machines/${machine}`)).status, 200);
  await second.stop();
});

test("two servers on one PostgreSQL deliver each event exactly once, and neither destroys the other's machines", async () => {
  const pg = await startPostgres();
  cleanups.push(() => pg.stop());
  const rx = await receiver();
  const env = { KILN_WEBHOOK_ALLOW_PRIVATE: "1", KILN_DATABASE_URL: pg.url };
  const a = track(await startServerProcess(await tempDir("kiln-wh-a-"), env));
  const hook = await a.call("POST", "/v1/lifecycle/webhooks", { url: `${rx.url}/both`, operations: ["create", "update", "destroy"] });
  assert.equal(hook.status, 201);
  const m1 = await createMachine(a);
  // B starts while A's machine runs: its adoption must leave that machine alone.
  const b = track(await startServerProcess(await tempDir("kiln-wh-b-"), env));
  const m2 = await createMachine(b);

  const updates = [];
  for (let i = 0; i < 20; i++) updates.push(i % 2 === 0 ? a.call("PATCH", `/v1/machines/${m1}`, { name: `a${i}` }) : b.call("PATCH", `/v1/machines/${m2}`, { name: `b${i}` }));
  for (const res of await Promise.all(updates)) assert.equal(res.status, 200);

  // A reconciliation pass (every 5 s) on each server with the other's machine in the store.
  await new Promise((r) => setTimeout(r, 6000));
  assert.equal((await b.call("GET", `/v1/machines/${m1}`)).body.status, "running", "B did not destroy A's machine");
  assert.equal((await a.call("GET", `/v1/machines/${m2}`)).body.status, "running", "A did not destroy B's machine");
  assert.equal((await a.call("POST", `/v1/machines/${m1}/exec`, { cmd: "echo alive" })).body.stdout, "alive\n");
  assert.equal((await b.call("POST", `/v1/machines/${m2}/exec`, { cmd: "echo alive" })).body.stdout, "alive\n");
  assert.equal((await a.call("DELETE", `/v1/machines/${m1}`)).status, 200);
  assert.equal((await b.call("DELETE", `/v1/machines/${m2}`)).status, 200);

  const events = 2 + 20 + 2;
  await rx.waitForCount((r) => r.path === "/both", events, 30_000);
  // Every delivery recorded as done, with one attempt each: nothing is still in flight to arrive twice.
  let all: any[] = [];
  for (let i = 0; i < 200; i++) {
    all = (await a.call("GET", `/v1/lifecycle/webhooks/${hook.body.id}/deliveries?limit=100`)).body.deliveries;
    if (all.length === events && all.every((d) => d.status === "succeeded")) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(all.length, events);
  for (const d of all) assert.deepEqual([d.status, d.attempts.length], ["succeeded", 1], d.id);
  const ids = rx.received.filter((r) => r.path === "/both").map((r) => String(r.headers["x-service-event-id"]));
  assert.equal(ids.length, events, "no event arrived twice");
  assert.equal(new Set(ids).size, events);

  // A backlog neither server was told about (written straight into the shared outbox): both dispatchers find it on
  // their own and claim side by side; SKIP LOCKED gives each delivery to exactly one of them.
  const backlog = await a.call("POST", "/v1/lifecycle/webhooks", { url: `${rx.url}/backlog`, operations: ["update"] });
  rx.respond = async () => {
    await new Promise((r) => setTimeout(r, 20));
    return { status: 200 };
  };
  const store = await openStore({ dataDir: "/nonexistent", databaseUrl: pg.url });
  try {
    await store.db.transaction().execute(async (tx) => {
      for (let i = 0; i < 300; i++) {
        const id = newId("evt");
        await enqueueDeliveries(tx, { id, operation: "update", occurredAt: new Date().toISOString(), payload: { id, operation: "update", n: i } });
      }
    });
  } finally {
    await store.close();
  }
  const got = await rx.waitForCount((r) => r.path === "/backlog", 300, 60_000);
  assert.equal(new Set(got.map((r) => String(r.headers["x-service-event-id"]))).size, 300);
  for (let i = 0; ; i++) {
    const all: any[] = [];
    let cursor: string | null = null;
    do {
      const page: any = (await b.call("GET", `/v1/lifecycle/webhooks/${backlog.body.id}/deliveries?limit=100${cursor ? `&cursor=${cursor}` : ""}`)).body;
      all.push(...page.deliveries);
      cursor = page.next_cursor;
    } while (cursor);
    if (all.length === 300 && all.every((d) => d.status === "succeeded")) {
      for (const d of all) assert.equal(d.attempts.length, 1, d.id);
      break;
    }
    assert.ok(i < 200, "the backlog was recorded as delivered");
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(rx.received.filter((r) => r.path === "/backlog").length, 300, "no delivery of the backlog arrived twice");
  const sentBy = (s: ServerProcess) => got.filter((r) => s.output().includes(String(r.headers["x-service-delivery-id"]))).length;
  process.stderr.write(`backlog of 300: server A sent ${sentBy(a)}, server B sent ${sentBy(b)}\n`);
  await a.stop();
  await b.stop();
});
