// The TypeScript SDK against a real Kiln: the typed client on generated types, exec and PTY streams over the
// machine WebSocket (PTY replay on a new socket), a build's log over SSE (resumed with Last-Event-ID), volume
// watches, and webhook signature verification of a real delivery.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createKiln, KilnApiError, verifyWebhook, WebhookVerificationError } from "../src/index.ts";
import type { BuildLogEntry, FileEvent, Kiln, ResyncRequired } from "../src/index.ts";
import { startTestKiln, TEST_KEY } from "../../../test/support/kiln.ts";
import type { TestKiln } from "../../../test/support/kiln.ts";
import { startReceiver } from "../../../test/webhooks/receiver.ts";
import type { Receiver } from "../../../test/webhooks/receiver.ts";

let k: TestKiln;
let kiln: Kiln;
let machineId: string;
before(async () => {
  k = await startTestKiln({ env: { KILN_WEBHOOK_ALLOW_PRIVATE: "1" } });
  kiln = createKiln({ baseUrl: k.url, apiKey: TEST_KEY });
});
after(async () => k?.close());

/** Resolves when `check` holds, polled on every call of the returned `poke` (events drive it, not the clock). */
function until<T>(check: () => T | undefined): { done: Promise<T>; poke: () => void } {
  let resolve!: (v: T) => void;
  const done = new Promise<T>((r) => (resolve = r));
  return {
    done,
    poke: () => {
      const v = check();
      if (v !== undefined) resolve(v);
    },
  };
}

test("the typed client: create and get a machine, and a refusal as Kiln's envelope", async () => {
  const created = await kiln.api.POST("/v1/machines", { body: { envs: { WHO: "sdk" } } });
  assert.equal(created.response.status, 201);
  machineId = created.data!.id;
  assert.match(machineId, /^mch_/);
  const got = await kiln.api.GET("/v1/machines/{id}", { params: { path: { id: machineId } } });
  assert.equal(got.data?.status, "running");
  const exec = await kiln.api.POST("/v1/machines/{id}/exec", { params: { path: { id: machineId } }, body: { cmd: "echo $WHO" } });
  assert.equal(exec.data?.stdout, "sdk\n");
  const missing = await kiln.api.GET("/v1/machines/{id}", { params: { path: { id: "mch_00000000000000000000000000" } } });
  assert.equal(missing.response.status, 404);
  assert.equal((missing.error as { code: string }).code, "not_found");
});

test("exec over the machine socket: stdin in, stdout and stderr out as they come, the exit code", async () => {
  const socket = await kiln.machineSocket(machineId);
  try {
    let out = "";
    let err = "";
    const proc = await socket.exec("cat; echo done >&2; exit 4", { stdin: true, onStdout: (d) => (out += Buffer.from(d)), onStderr: (d) => (err += Buffer.from(d)) });
    assert.ok(proc.pid > 0);
    proc.write("through stdin\n");
    proc.closeStdin();
    assert.deepEqual(await proc.wait(), { exit_code: 4, signal: null });
    assert.equal(out, "through stdin\n");
    assert.equal(err, "done\n");
  } finally {
    await socket.close();
  }
});

test("a PTY session outlives its socket: attaching on a new one replays what was missed, once", async () => {
  const first = await kiln.machineSocket(machineId);
  let seen = "";
  // The shell computes the mark, so the typed line (echoed by the terminal) never contains it.
  const echoed = until(() => (seen.includes("first-42") ? true : undefined));
  const session = await first.pty({ cols: 80, rows: 24, cmd: "/bin/sh", onData: (d) => ((seen += Buffer.from(d)), echoed.poke()) });
  session.write("echo first-$((40+2))\n");
  await echoed.done;
  const offset = session.offset;
  await first.close();

  // While no socket is attached, the shell prints more; the new socket gets exactly the bytes after `offset`.
  const second = await kiln.machineSocket(machineId);
  try {
    let replayed = "";
    const later = until(() => (replayed.includes("second-42") ? true : undefined));
    const again = await second.attachPty(session.sessionId, offset, (d) => ((replayed += Buffer.from(d)), later.poke()));
    assert.equal(again.truncated, false);
    again.write("echo second-$((40+2))\n");
    await later.done;
    assert.ok(!replayed.includes("first-42"), "bytes before the offset are not replayed");
    again.write("exit 7\n");
    assert.deepEqual(await again.exited, { exit_code: 7, signal: null });
  } finally {
    await second.close();
  }
});

test("a refused socket throws Kiln's envelope (unknown machine: not_found)", async () => {
  await assert.rejects(kiln.machineSocket("mch_00000000000000000000000000"), (err: unknown) => err instanceof KilnApiError && err.status === 404 && err.code === "not_found");
  const stranger = createKiln({ baseUrl: k.url, apiKey: "kiln_wrong_0000000000000000000000000000" });
  await assert.rejects(stranger.machineSocket(machineId), (err: unknown) => err instanceof KilnApiError && err.code === "unauthorized");
});

test("a build's log streams live over SSE, and the logs route resumes after a given entry with Last-Event-ID", async () => {
  const entries: BuildLogEntry[] = [];
  for await (const e of kiln.build({ name: "sdk-logs", steps: [{ type: "run", command: "echo one" }, { type: "run", command: "echo two" }] })) entries.push(e);
  assert.equal(entries[0].kind, "start");
  assert.equal(entries.at(-1)!.kind, "end", JSON.stringify(entries.at(-1)));
  assert.deepEqual(
    entries.map((e) => e.seq),
    entries.map((_, i) => entries[0].seq + i),
    "every entry once, in order",
  );
  const { template_id, build_id } = entries[0];
  const middle = entries[Math.floor(entries.length / 2)].seq;
  const rest: BuildLogEntry[] = [];
  for await (const e of kiln.buildLogs(template_id, build_id, middle)) rest.push(e);
  assert.deepEqual(
    rest.map((e) => e.seq),
    entries.filter((e) => e.seq > middle).map((e) => e.seq),
  );
  const refused = kiln.build({ tags: [] });
  await assert.rejects(refused.next(), (err: unknown) => err instanceof KilnApiError && err.code === "invalid_request");
});

test("a build stream that drops mid-way is resumed from the logs route: every entry once, to the end", async () => {
  // A fetch whose first build answer breaks after two chunks, as a dropped connection does.
  let cut = false;
  const dropping: typeof fetch = async (input, init) => {
    const res = await fetch(input, init);
    if (cut || !String(input).endsWith("/v1/templates/build") || !res.body) return res;
    cut = true;
    const reader = res.body.getReader();
    let chunks = 0;
    const body = new ReadableStream<Uint8Array>({
      async pull(controller) {
        const { value, done } = await reader.read();
        if (done || ++chunks > 2) {
          void reader.cancel();
          controller.error(new Error("connection dropped"));
        } else controller.enqueue(value);
      },
    });
    return new Response(body, { status: res.status, headers: res.headers });
  };
  const flaky = createKiln({ baseUrl: k.url, apiKey: TEST_KEY, fetch: dropping });
  const entries: BuildLogEntry[] = [];
  for await (const e of flaky.build({ name: "sdk-resume", steps: [{ type: "run", command: "echo a" }, { type: "run", command: "echo b" }] })) entries.push(e);
  assert.ok(cut, "the first stream was cut");
  assert.equal(entries[0].kind, "start");
  assert.equal(entries.at(-1)!.kind, "end");
  assert.deepEqual(
    entries.map((e) => e.seq),
    entries.map((_, i) => entries[0].seq + i),
  );
});

test("the OpenAPI document lists the WebSocket routes with their 101 upgrade", async () => {
  const doc = (await k.call("GET", "/v1/openapi.json", { key: null })).body;
  for (const path of ["/v1/machines/{id}/ws", "/v1/volumes/{id}/ws"]) assert.ok(doc.paths[path]?.get?.responses?.["101"], `${path} documents its 101`);
  assert.ok(doc.paths["/v1/mcp"]?.post, "the MCP route is documented");
});

test("a volume watch reports a file written to the volume", async () => {
  const vol = await kiln.api.POST("/v1/volumes", { body: { name: "sdk-watch", size_mb: 16 } });
  assert.equal(vol.response.status, 201, JSON.stringify(vol.error));
  const watcher = await kiln.volumeWatcher(vol.data!.id);
  try {
    const events: (FileEvent | ResyncRequired)[] = [];
    const written = until(() => events.find((e) => e.type === "file_event" && e.path === "/notes/a.txt"));
    const watch = await watcher.watch("/", (e) => (events.push(e), written.poke()), { recursive: true });
    assert.ok(watch.watchId);
    const put = await k.call("PUT", `/v1/volumes/${vol.data!.id}/files?path=${encodeURIComponent("/notes/a.txt")}`, { raw: "hi", headers: { "content-type": "application/octet-stream" } });
    assert.equal(put.status, 200, put.text);
    const event = (await written.done) as FileEvent;
    assert.ok(["create", "write"].includes(event.event));
    await watch.unwatch();
  } finally {
    await watcher.close();
  }
});

test("verifyWebhook accepts a real delivery and refuses a tampered body, another secret and a stale timestamp", async () => {
  const receiver: Receiver = await startReceiver();
  try {
    const secret = "whsec_" + Buffer.from("sdk-webhook-secret-0123456789abcd").toString("base64");
    const hook = await kiln.api.POST("/v1/lifecycle/webhooks", { body: { url: `${receiver.url}/hook`, operations: ["create"], signing_secret: secret } });
    assert.equal(hook.response.status, 201, JSON.stringify(hook.error));
    const made = await kiln.api.POST("/v1/machines", { body: {} });
    const delivery = await receiver.waitFor((r) => r.path === "/hook" && r.body.includes(made.data!.id));
    const event = verifyWebhook(secret, delivery.headers, delivery.body);
    assert.equal(event.operation, "create");
    assert.equal((event.machine as { id: string }).id, made.data!.id);
    assert.throws(() => verifyWebhook(secret, delivery.headers, delivery.body.replace("create", "destroy")), WebhookVerificationError);
    assert.throws(() => verifyWebhook("whsec_" + Buffer.from("another-secret-0123456789abcdefgh").toString("base64"), delivery.headers, delivery.body), WebhookVerificationError);
    assert.throws(() => verifyWebhook(secret, delivery.headers, delivery.body, { now: new Date(Date.now() + 3600_000) }), /more than 300 s/);
  } finally {
    await receiver.close();
  }
});
