// Teardown off the request path: DELETE answers once the machine is unreachable (processes killed, record destroyed,
// agent connection closed) and its remains go behind it; a server killed with SIGKILL right after the DELETEs leaves
// nothing behind once the next server has started (processes, mounts, cgroups, loop devices, netns, uid ranges).

import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import { remainsOf } from "../support/remains.ts";
import { TEST_CACHE_DIR, TEST_RUNTIME } from "../support/paths.ts";
import { freePort } from "../support/net.ts";

const KILN = join(import.meta.dirname, "..", "..", "bin", "kiln");

async function until(what: string, check: () => boolean | Promise<boolean>, timeoutMs = 30_000) {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

test("DELETE answers once the machine is unreachable; its remains are removed behind it", async () => {
  const k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  try {
    const made = await k.call("POST", "/v1/machines", { body: { internet: true } });
    assert.equal(made.status, 201, made.text);
    const id = made.body.id as string;
    const live = (await k.kiln.services.driver.listLive()).find((l) => l.id === id)!;
    const del = await k.call("DELETE", `/v1/machines/${id}`, { settle: false });
    assert.equal(del.status, 200, del.text);
    assert.equal(del.body.status, "destroyed");
    // Unreachable at once: no exec reaches it, and its processes were sent SIGKILL (dead, or exiting as zombies).
    const exec = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd: "echo hi" } });
    assert.equal(exec.status, 409, exec.text);
    await until("the machine's first process to be gone", () => {
      try {
        return readFileSync(`/proc/${live.pid}/stat`, "utf8").split(") ")[1].startsWith("Z");
      } catch {
        return true;
      }
    });
    assert.equal(await k.kiln.services.machines.cleanupsSettled(60_000), true, "the cleanup finished");
    assert.deepEqual(remainsOf(k.dataDir, id), []);
    const ready = await k.call("GET", "/v1/ready");
    assert.equal(ready.status, 200);
    assert.equal(ready.body.capacity?.live_machines ?? ready.body.live_machines ?? 0, 0);
  } finally {
    await k.close();
  }
});

test("a destroyed machine still being cleaned counts for admission until its cleanup is done", async () => {
  const k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  try {
    const made = await k.call("POST", "/v1/machines", { body: { memory_mb: 700 } });
    assert.equal(made.status, 201, made.text);
    const { machines, admission } = k.kiln.services;
    // The destroy returns with the cleanup queued (before the record is written); its first step alone (the runtime's
    // delete, a process of its own waiting for the killed processes) outlasts the look that follows.
    await machines.destroy(made.body.id);
    const during = await admission.capacity();
    assert.equal(during.live_machines, 1, "the machine being cleaned still counts");
    assert.equal(during.declared_memory_mb, 700, "with the memory it was given");
    assert.equal(await machines.cleanupsSettled(60_000), true);
    const after = await admission.capacity();
    assert.equal(after.live_machines, 0);
    assert.equal(after.declared_memory_mb, 0);
  } finally {
    await k.close();
  }
});

test("a volume deleted right after the machine that mounted it waits for that machine's cleanup; nothing is left", async () => {
  const k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  try {
    const vol = await k.call("POST", "/v1/volumes", { body: { name: "teardown", size_mb: 16 } });
    assert.equal(vol.status, 201, vol.text);
    const made = await k.call("POST", "/v1/machines", { body: { volumes: [{ volume_id: vol.body.id, path: "/data" }] } });
    assert.equal(made.status, 201, made.text);
    assert.equal((await k.call("POST", `/v1/machines/${made.body.id}/exec`, { body: { cmd: "echo x > /data/f" } })).status, 200);
    assert.equal((await k.call("DELETE", `/v1/machines/${made.body.id}`, { settle: false })).status, 200);
    const gone = await k.call("DELETE", `/v1/volumes/${vol.body.id}`);
    assert.equal(gone.status, 204, gone.text);
    assert.equal(await k.kiln.services.machines.cleanupsSettled(60_000), true);
    assert.deepEqual(remainsOf(k.dataDir, made.body.id), []);
    const volumeDir = join(k.dataDir, "volumes", vol.body.id);
    assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(volumeDir), "the volume is not mounted anywhere");
    assert.ok(!execFileSync("losetup", ["-a"], { encoding: "utf8" }).includes(volumeDir), "its loop device is gone");
  } finally {
    await k.close();
  }
});

test("DELETE then kill -9 of the server leaves nothing behind after the next start", async () => {
  const dataDir = await mkdtemp(join(tmpdir(), "kiln-teardown-crash-"));
  const env = { ...process.env, KILN_DATA_DIR: dataDir, KILN_CACHE_DIR: TEST_CACHE_DIR, KILN_API_KEY: TEST_KEY, KILN_WARM_POOL: "0", KILN_OCI_RUNTIME: TEST_RUNTIME };
  const auth = { authorization: `Bearer ${TEST_KEY}` };
  const serve = async () => {
    const port = await freePort();
    const server = spawn(KILN, ["serve", "--port", String(port)], { env, stdio: ["ignore", "ignore", "ignore"] });
    const exited = new Promise<void>((resolve) => server.on("exit", () => resolve()));
    return { server, exited, url: `http://127.0.0.1:${port}` };
  };
  const call = async (url: string, method: string, path: string, body?: unknown) => {
    const headers = body === undefined ? auth : { ...auth, "content-type": "application/json" };
    const res = await request(url + path, { method: method as "GET", headers, body: body === undefined ? undefined : JSON.stringify(body) });
    const text = await res.body.text();
    return { status: res.statusCode, body: text ? JSON.parse(text) : undefined, text };
  };
  let first = await serve();
  let second: Awaited<ReturnType<typeof serve>> | undefined;
  const ids: string[] = [];
  try {
    // Machines of several kinds: with a network helper, with egress rules of their own, with no network.
    const shapes = [{ internet: true }, { internet: true, network: { deny_out: ["10.0.0.0/8"] } }, { internet: false, memory_mb: 256 }];
    for (const shape of shapes) {
      let made: Awaited<ReturnType<typeof call>> | undefined;
      // The first create also waits for the server to come up (and its base template to be registered).
      for (let i = 0; i < 600 && made?.status !== 201; i++) {
        made = await call(first.url, "POST", "/v1/machines", shape).catch(() => undefined);
        if (made?.status !== 201) await new Promise((r) => setTimeout(r, 100));
      }
      assert.equal(made?.status, 201, made?.text);
      ids.push(made!.body.id);
    }
    const dels = await Promise.all(ids.map((id) => call(first.url, "DELETE", `/v1/machines/${id}`)));
    for (const d of dels) assert.equal(d.status, 200, d.text);
    // Straight after the answers, while the cleanups run: the server dies with no chance to finish them.
    first.server.kill("SIGKILL");
    await first.exited;
    // The kill cut cleanups short (each takes the runtime's delete, umounts and rm: far longer than the kill).
    const cutShort = ids.filter((id) => remainsOf(dataDir, id).length > 0);
    assert.ok(cutShort.length > 0, "the server died with cleanups unfinished");
    second = await serve();
    // The next start finishes what the killed one left, before it serves.
    await until("the next server to serve", async () => (await call(second!.url, "GET", "/v1/ready").catch(() => undefined))?.status === 200, 120_000);
    for (const id of ids) {
      const g = await call(second.url, "GET", `/v1/machines/${id}`);
      assert.equal(g.body.status, "destroyed");
      assert.deepEqual(remainsOf(dataDir, id), [], `nothing of ${id} is left`);
    }
  } finally {
    for (const s of [first, second]) {
      if (s && s.server.exitCode === null && s.server.signalCode === null) {
        s.server.kill("SIGTERM");
        await s.exited;
      }
    }
    // A failed assert may leave machines: a last server removes them (its start does), then the data dir goes.
    const last = await startTestKiln({ dataDir });
    await last.close();
    await rm(dataDir, { recursive: true, force: true });
  }
});
