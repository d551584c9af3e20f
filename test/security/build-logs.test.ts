// Build logs hold what was printed: a step printing 200,000 lines keeps every one, on SQLite and on PostgreSQL, and
// the replay of the finished build is exactly the live stream (entries, ids, count); past KILN_BUILD_LOG_MAX_BYTES
// one `log truncated` entry says so; a client that never reads its SSE stream costs the server bounded memory and
// still gets every entry, in order, once it reads.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { connect } from "node:net";
import type { Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import type { TestRegistry } from "../support/oci-registry.ts";
import { TEST_CACHE_DIR } from "../support/paths.ts";
import { startPostgres } from "../support/postgres.ts";
import { build, parseSse } from "../builds/support.ts";
import type { SseEvent } from "../builds/support.ts";
import { busyboxRegistry, buildSkip } from "./build-support.ts";
import { freePort } from "../support/net.ts";

const skip = buildSkip();
const KILN = join(import.meta.dirname, "..", "..", "bin", "kiln");
let reg: TestRegistry;
let image: string;

before(async () => {
  if (skip) return;
  ({ reg, image } = await busyboxRegistry());
});

after(async () => {
  if (!skip) await reg.stop();
});

/** The build's log replayed after it ended (GET …/logs), as SSE events. */
async function replay(url: string, templateId: string, buildId: string): Promise<SseEvent[]> {
  const res = await request(`${url}/v1/templates/${templateId}/builds/${buildId}/logs`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  assert.equal(res.statusCode, 200);
  return parseSse(await res.body.text());
}

async function twoHundredThousandLines(k: TestKiln) {
  const live = await build(k, { name: `lines-${randomBytes(3).toString("hex")}`, dockerfile: `FROM ${image}\nRUN seq 1 200000\n`, skip_cache: true });
  assert.equal(live.status, 200);
  const end = live.events.at(-1)!;
  assert.equal(end.event, "end", JSON.stringify(end.data));
  const numbers = live.events.filter((e) => e.event === "message" && /^\d+$/.test(e.data.message)).map((e) => Number(e.data.message));
  assert.equal(numbers.length, 200_000, "every printed line is an entry");
  assert.ok(
    numbers.every((n, i) => n === i + 1),
    "in the order printed",
  );
  assert.ok(
    live.events.every((e, i) => e.id === i + 1),
    "ids are 1, 2, 3, … without a gap",
  );
  const again = await replay(k.url, end.data.template_id, end.data.build_id);
  assert.equal(again.length, live.events.length, "the replay has as many entries as the live stream");
  assert.deepEqual(again, live.events, "and they are the same entries with the same ids");
}

test("a step printing 200,000 lines keeps them all; the replay is exactly the live stream (SQLite)", { skip }, async () => {
  const k = await startTestKiln({ env: { KILN_INSECURE_REGISTRIES: reg.host, KILN_WARM_POOL: "0" }, waitForBase: false });
  try {
    await twoHundredThousandLines(k);
  } finally {
    await k.close();
  }
});

test("a step printing 200,000 lines keeps them all; the replay is exactly the live stream (PostgreSQL)", { skip }, async () => {
  const pg = await startPostgres();
  const k = await startTestKiln({ env: { KILN_INSECURE_REGISTRIES: reg.host, KILN_WARM_POOL: "0", KILN_DATABASE_URL: pg.url }, waitForBase: false });
  try {
    await twoHundredThousandLines(k);
  } finally {
    await k.close();
    await pg.stop();
  }
});

test("past KILN_BUILD_LOG_MAX_BYTES one `log truncated` entry is kept, then only what is not output; replay = live", { skip }, async () => {
  const max = 256 * 1024;
  const k = await startTestKiln({ env: { KILN_INSECURE_REGISTRIES: reg.host, KILN_WARM_POOL: "0", KILN_BUILD_LOG_MAX_BYTES: String(max) }, waitForBase: false });
  try {
    const live = await build(k, { name: "truncated", dockerfile: `FROM ${image}\nRUN seq 1 100000\n`, skip_cache: true });
    const end = live.events.at(-1)!;
    assert.equal(end.event, "end", "the build still ends and says so");
    const cut = live.events.filter((e) => e.data.metadata?.log_truncated === true);
    assert.equal(cut.length, 1, "one entry says the log was truncated");
    assert.equal(cut[0].event, "warning");
    assert.match(cut[0].data.message, /^log truncated: this build's log reached 262144 bytes \(KILN_BUILD_LOG_MAX_BYTES\)/);
    const before = live.events.filter((e) => e.id < cut[0].id);
    const bytes = before.reduce((n, e) => n + JSON.stringify(e.data).length, 0);
    assert.ok(bytes >= max - 16 * 1024 && bytes <= max + 16 * 1024, `the log was cut at the cap (${bytes} bytes before the entry)`);
    assert.ok(!live.events.some((e) => e.id > cut[0].id && e.event === "message"), "no output line after it");
    assert.deepEqual(await replay(k.url, end.data.template_id, end.data.build_id), live.events, "replay = live");
  } finally {
    await k.close();
  }
});

/** An HTTP/1.1 chunked body (read as latin1, so lengths are bytes) without its chunk framing. */
function dechunk(body: string): string {
  let out = "";
  for (let at = 0; at < body.length; ) {
    const eol = body.indexOf("\r\n", at);
    const size = parseInt(body.slice(at, eol), 16);
    if (!size) break;
    out += body.slice(eol + 2, eol + 2 + size);
    at = eol + 2 + size + 2;
  }
  return out;
}

const rssMb = (pid: number) => Number(/^VmRSS:\s+(\d+) kB/m.exec(readFileSync(`/proc/${pid}/status`, "utf8"))![1]) / 1024;

test("a client that never reads its SSE stream costs the server bounded memory, and later reads every entry", { skip }, async (t) => {
  const dataDir = await mkdtemp(join(tmpdir(), "kiln-slow-reader-"));
  const port = await freePort();
  const env = { ...process.env, KILN_DATA_DIR: dataDir, KILN_CACHE_DIR: TEST_CACHE_DIR, KILN_API_KEY: TEST_KEY, KILN_WARM_POOL: "0", KILN_INSECURE_REGISTRIES: reg.host, KILN_BUILD_LOG_MAX_BYTES: String(1024 * 1024 * 1024) };
  const server = spawn(KILN, ["serve", "--port", String(port)], { env, stdio: ["ignore", "ignore", "ignore"] });
  const exited = new Promise<void>((resolve) => server.on("exit", () => resolve()));
  const url = `http://127.0.0.1:${port}`;
  let socket: Socket | undefined;
  try {
    for (let i = 0; ; i++) {
      const ok = await request(`${url}/health`).then(async (r) => (await r.body.dump(), r.statusCode === 200)).catch(() => false);
      if (ok) break;
      assert.ok(i < 1200, "the server came up");
      await new Promise((r) => setTimeout(r, 100));
    }
    const baseline = rssMb(server.pid!);
    // 50,000 lines of 3,000 bytes: 150 MB of output, every line an entry.
    const name = `flood-${randomBytes(3).toString("hex")}`;
    const body = JSON.stringify({ name, dockerfile: `FROM ${image}\nRUN yes "$(head -c 3000 /dev/zero | tr '\\0' x)" | head -n 50000\n`, skip_cache: true });
    socket = connect(port, "127.0.0.1");
    await new Promise<void>((resolve, reject) => socket!.once("connect", () => resolve()).once("error", reject));
    socket.pause(); // never read
    socket.write(`POST /v1/templates/build HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${TEST_KEY}\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`);
    let peak = baseline;
    let status = "";
    for (let i = 0; status !== "ready" && status !== "error"; i++) {
      peak = Math.max(peak, rssMb(server.pid!));
      const r = await request(`${url}/v1/templates/${name}/builds?limit=1`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
      const list = (await r.body.json()) as { builds?: { status: string }[] };
      status = list.builds?.[0]?.status ?? "";
      assert.ok(i < 6000, "the build ended");
      await new Promise((r) => setTimeout(r, 100));
    }
    assert.equal(status, "ready");
    for (let i = 0; i < 10; i++) {
      peak = Math.max(peak, rssMb(server.pid!));
      await new Promise((r) => setTimeout(r, 100));
    }
    t.diagnostic(`server RSS ${Math.round(baseline)} MB before, ${Math.round(peak)} MB at most while 150 MB of log went unread`);
    assert.ok(peak - baseline < 100, `150 MB of log never read by its client grew the server by ${Math.round(peak - baseline)} MB (from ${Math.round(baseline)} MB)`);

    // Now it reads: every entry arrives, in order, ending with `end`, as the replay has them.
    let raw = "";
    socket.on("data", (c: Buffer) => (raw += c.toString("latin1")));
    socket.resume();
    const deadline = Date.now() + 300_000;
    while (!/\nevent: end\n/.test(raw.slice(-20000))) {
      assert.ok(Date.now() < deadline, "the slow reader got to the end entry");
      await new Promise((r) => setTimeout(r, 100));
    }
    const events = parseSse(dechunk(raw.slice(raw.indexOf("\r\n\r\n") + 4)));
    assert.ok(
      events.every((e, i) => e.id === i + 1),
      "ids 1, 2, 3, … without a gap",
    );
    assert.equal(events.filter((e) => e.event === "message" && e.data.message.length === 3000).length, 50_000, "every line reached the slow reader");
    assert.equal(events.at(-1)!.event, "end");
  } finally {
    socket?.destroy();
    server.kill("SIGTERM");
    await exited;
    await rm(dataDir, { recursive: true, force: true });
  }
});
