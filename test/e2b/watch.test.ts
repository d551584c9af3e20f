// The `e2b` SDK's sandbox.files.watchDir against a real Kiln (the guest agent's watches, inside the machine), and
// envd's polled watcher trio (CreateWatcher / GetWatcherEvents / RemoveWatcher) over Connect JSON.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { Sandbox, NotFoundError, FilesystemEventType } from "e2b";
import type { FilesystemEvent, SandboxOpts } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";

let k: TestKiln;
let opts: SandboxOpts;
let sbx: Sandbox;

before(async () => {
  k = await startTestKiln();
  const key = (await k.kiln.services.keys.create("e2b-watch", generateKeyIn("e2b"))).key;
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 30_000 };
  sbx = await Sandbox.create("base", opts);
});
after(async () => k?.close());

/** Collects events and waits for one matching. */
function eventLog() {
  const events: FilesystemEvent[] = [];
  const waiters: { pred: (e: FilesystemEvent) => boolean; resolve: () => void }[] = [];
  return {
    events,
    onEvent: (e: FilesystemEvent) => {
      events.push(e);
      for (const w of waiters.filter((x) => x.pred(e))) {
        waiters.splice(waiters.indexOf(w), 1);
        w.resolve();
      }
    },
    until(pred: (e: FilesystemEvent) => boolean, what: string) {
      if (events.some(pred)) return Promise.resolve();
      return new Promise<void>((resolve, reject) => {
        const t = setTimeout(() => reject(new Error(`no ${what} in 10 s; got ${JSON.stringify(events)}`)), 10_000);
        waiters.push({ pred, resolve: () => (clearTimeout(t), resolve()) });
      });
    },
  };
}

test("files.watchDir reports create, write and remove with names relative to the directory, recursively when asked", async () => {
  await sbx.files.makeDir("watched/sub");
  const log = eventLog();
  const handle = await sbx.files.watchDir("watched", log.onEvent, { recursive: true });
  await sbx.files.write("watched/new.txt", "hello");
  await log.until((e) => e.name === "new.txt" && e.type === FilesystemEventType.CREATE, "create of new.txt");
  await log.until((e) => e.name === "new.txt" && e.type === FilesystemEventType.WRITE, "write of new.txt");
  // The chmod comes in a later command: one inside the clock tick of the write leaves no trace fs.watch can tell
  // from a second write when the agent handles the create after both (docs/e2b.md, event kinds).
  await sbx.commands.run("echo deep > watched/sub/deep.txt");
  await log.until((e) => e.name === "sub/deep.txt" && e.type === FilesystemEventType.CREATE, "create of sub/deep.txt");
  await sbx.commands.run("chmod 600 watched/sub/deep.txt && rm watched/new.txt");
  await log.until((e) => e.name === "sub/deep.txt" && e.type === FilesystemEventType.CHMOD, "chmod of sub/deep.txt");
  await log.until((e) => e.name === "new.txt" && e.type === FilesystemEventType.REMOVE, "remove of new.txt");
  await handle.stop();
  const seen = log.events.length;
  await sbx.files.write("watched/later.txt", "x");
  await sbx.commands.run("true"); // a round trip through the agent after the write
  assert.equal(log.events.length, seen, "no events after stop()");
});

test("files.watchDir without recursive sees direct children only; a missing directory is NotFoundError", async () => {
  await sbx.files.makeDir("flat/inner");
  const log = eventLog();
  const handle = await sbx.files.watchDir("flat", log.onEvent);
  await sbx.commands.run("echo x > flat/inner/deep.txt && echo y > flat/top.txt");
  await log.until((e) => e.name === "top.txt", "event of top.txt");
  assert.ok(!log.events.some((e) => e.name.startsWith("inner/")));
  await handle.stop();
  await assert.rejects(sbx.files.watchDir("/no/such/dir", () => undefined), NotFoundError);
});

test("the polled watcher trio: CreateWatcher, GetWatcherEvents drains what happened, RemoveWatcher ends it", async () => {
  const token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
  const call = async (method: string, body: unknown) => {
    const res = await request(`${k.url}/filesystem.Filesystem/${method}`, {
      method: "POST",
      headers: { "e2b-sandbox-id": sbx.sandboxId, "x-access-token": token, "content-type": "application/json" },
      body: JSON.stringify(body),
    });
    return { status: res.statusCode, body: (await res.body.json()) as any };
  };
  await sbx.files.makeDir("/tmp/polled");
  const created = await call("CreateWatcher", { path: "/tmp/polled", recursive: false });
  assert.equal(created.status, 200);
  const watcherId = created.body.watcherId as string;
  assert.ok(watcherId);
  await sbx.commands.run("touch /tmp/polled/a");
  let events: any[] = [];
  for (let i = 0; i < 50 && !events.some((e) => e.name === "a"); i++) {
    events = events.concat((await call("GetWatcherEvents", { watcherId })).body.events);
    if (!events.length) await sbx.commands.run("true");
  }
  assert.deepEqual(events.find((e) => e.name === "a"), { name: "a", type: "EVENT_TYPE_CREATE" });
  assert.deepEqual((await call("GetWatcherEvents", { watcherId })).body.events, []);
  assert.equal((await call("RemoveWatcher", { watcherId })).status, 200);
  const gone = await call("GetWatcherEvents", { watcherId });
  assert.equal(gone.status, 404);
  assert.equal(gone.body.code, "not_found");
});
