// A `kiln serve` killed with SIGKILL while a volume is watched: its watcher dies with it (nothing is left running),
// the volume stays mounted and recorded, and the next server serves and deletes it without leaks.

import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { mkdtemp } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { request } from "undici";
import { WebSocket } from "ws";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import { TEST_CACHE_DIR } from "../support/paths.ts";
import { freePort } from "../support/net.ts";

const KILN = join(import.meta.dirname, "..", "..", "bin", "kiln");

/** Pids of processes whose parent is `ppid` and whose command is `comm`. */
function childrenNamed(ppid: number, comm: string): number[] {
  const out: number[] = [];
  for (const d of readdirSync("/proc")) {
    if (!/^\d+$/.test(d)) continue;
    try {
      const stat = readFileSync(`/proc/${d}/stat`, "utf8");
      const name = stat.slice(stat.indexOf("(") + 1, stat.lastIndexOf(")"));
      const parent = Number(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[1]);
      if (parent === ppid && name === comm) out.push(Number(d));
    } catch {
      // gone meanwhile
    }
  }
  return out;
}

async function until(what: string, check: () => boolean, timeoutMs = 10_000) {
  const deadline = Date.now() + timeoutMs;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

test("kill -9 of the server ends its volume watchers; the volume survives and is deleted cleanly by the next server", async () => {
  const dataDir = await mkdtemp(join(tmpdir(), "kiln-vol-crash-"));
  const port = await freePort();
  const server = spawn(KILN, ["serve", "--port", String(port)], {
    env: { ...process.env, KILN_DATA_DIR: dataDir, KILN_CACHE_DIR: TEST_CACHE_DIR, KILN_API_KEY: TEST_KEY, KILN_WARM_POOL: "0" },
    stdio: ["ignore", "ignore", "ignore"],
  });
  const exited = new Promise<void>((resolve) => server.on("exit", () => resolve()));
  const url = `http://127.0.0.1:${port}`;
  const auth = { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" };
  let volume: { id: string } | undefined;
  try {
    for (let i = 0; i < 300 && !volume; i++) {
      const res = await request(`${url}/v1/volumes`, { method: "POST", headers: auth, body: JSON.stringify({ name: "crash", size_mb: 16 }) }).catch(() => undefined);
      if (res?.statusCode === 201) volume = (await res.body.json()) as { id: string };
      else {
        await res?.body.dump();
        await new Promise((r) => setTimeout(r, 100));
      }
    }
    assert.ok(volume, "the server came up and made a volume");
    const ws = new WebSocket(`ws://127.0.0.1:${port}/v1/volumes/${volume.id}/ws`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
    await new Promise((resolve, reject) => ws.once("open", resolve).once("error", reject));
    ws.send(JSON.stringify({ type: "file_watch", request_id: "r", path: "/", recursive: true }));
    const started = await new Promise<any>((resolve) => ws.once("message", (d) => resolve(JSON.parse(d.toString()))));
    assert.equal(started.type, "file_watch.started");
    ws.on("error", () => undefined);
    const watchers = childrenNamed(server.pid!, "inotifywait");
    assert.equal(watchers.length, 1, "one watcher for the volume, a child of the server");

    server.kill("SIGKILL");
    await exited;
    await until("the watcher to die with its server", () => !existsSync(`/proc/${watchers[0]}`));
  } finally {
    if (server.exitCode === null && server.signalCode === null) server.kill("SIGKILL");
  }

  // The next server finds the volume mounted and recorded; deleting it leaves no mount and no loop device.
  const k = await startTestKiln({ dataDir, env: { KILN_WARM_POOL: "0" } });
  try {
    assert.equal((await k.call("GET", `/v1/volumes/${volume.id}`)).body.status, "ready");
    assert.equal((await k.call("PUT", `/v1/volumes/${volume.id}/files?path=/after`, { raw: "x", headers: { "content-type": "application/octet-stream" } })).status, 200);
    assert.equal((await k.call("DELETE", `/v1/volumes/${volume.id}`)).status, 204);
    assert.equal(execFileSync("losetup", ["-a"], { encoding: "utf8" }).includes(join(dataDir, "volumes")), false);
    assert.equal(readFileSync("/proc/self/mountinfo", "utf8").includes(join(dataDir, "volumes")), false);
  } finally {
    await k.close();
  }
});
