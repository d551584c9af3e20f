// Dockerfile builds end: a RUN tree (background and setsid'd children included) is killed at the step timeout, at
// the build timeout, on cancel, and when the server is killed with SIGKILL — and the next start of the server
// removes everything the dead build left on the host (processes, mounts, namespaces, cgroups, egress rules, dirs).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { openSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestRegistry } from "../support/oci-registry.ts";
import { TEST_CACHE_DIR } from "../support/paths.ts";
import { build, parseSse } from "../builds/support.ts";
import { buildKeyOf, busyboxRegistry, buildSkip, leftovers, processes, until } from "./build-support.ts";
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

/** A RUN whose tree has a background child, a setsid'd daemon and a foreground sleep, each findable by `tag`. */
function sleeper(tag: number): string {
  return `RUN sleep ${tag}1 & (setsid sleep ${tag}2 &); sleep ${tag}3`;
}

const tagged = (tag: number) => processes().filter((p) => new RegExp(`^sleep ${tag}[123]$`).test(p.cmdline));

/** Waits for the sleeper's foreground sleep; returns the build's key, read off its cgroup. */
async function runningKey(tag: number): Promise<string> {
  const p = await until(`the RUN step (sleep ${tag}3) to run`, () => processes().find((p) => p.cmdline === `sleep ${tag}3`));
  const key = buildKeyOf(p.cgroup);
  assert.ok(key, `the RUN step is in a build's cgroup: ${p.cgroup}`);
  assert.ok(p.uid >= 1_000_000_000 && p.uid < 1_000_065_536, `the RUN step runs as a build uid, not ${p.uid}`);
  return key;
}

/** Starts a build through the API and reads its SSE stream in the background. */
async function startBuild(url: string, body: unknown) {
  const res = await request(`${url}/v1/templates/build`, { method: "POST", headers: AUTH, body: JSON.stringify(body) });
  assert.equal(res.statusCode, 200);
  let raw = "";
  const done = new Promise<void>((resolve) => {
    res.body.on("data", (c: Buffer) => (raw += c.toString()));
    res.body.on("end", () => resolve());
    res.body.on("error", () => resolve());
  });
  const events = () => parseSse(raw.slice(0, raw.lastIndexOf("\n\n") + 2));
  const start = await until("the start entry", () => events().find((e) => e.event === "start"));
  return { events, done, buildId: start.data.build_id as string, templateId: start.data.template_id as string };
}

/** Waits until a server answers /health. */
async function healthy(url: string, timeoutMs = 120_000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const ok = await request(`${url}/health`)
      .then(async (r) => (await r.body.dump(), r.statusCode === 200))
      .catch(() => false);
    if (ok) return;
    if (Date.now() > deadline) throw new Error(`${url} did not come up`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

const AUTH = { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" };

test("a RUN tree is killed at the step timeout and at the build timeout; nothing of the build is left", { skip }, async () => {
  const k = await startTestKiln({ env: { KILN_INSECURE_REGISTRIES: reg.host, KILN_WARM_POOL: "0", KILN_BUILD_STEP_TIMEOUT_S: "8", KILN_BUILD_TIMEOUT_S: "20" }, waitForBase: false });
  try {
    const tag = 4000 + Math.floor(Math.random() * 900);
    const started = Date.now();
    const stepBuild = build(k, { name: "step-timeout", dockerfile: `FROM ${image}\n${sleeper(tag)}\n`, skip_cache: true });
    const key = await runningKey(tag);
    const r = await stepBuild;
    const last = r.events.at(-1)!;
    assert.equal(last.event, "error");
    assert.match(last.data.message, /step 2\/2 \(RUN .*\) ran longer than 8 s and was stopped/);
    assert.ok(Date.now() - started < 60_000, "the build ended at its step timeout");
    assert.deepEqual(tagged(tag), [], "no process of the RUN tree is left (background and setsid'd children included)");
    assert.deepEqual(leftovers(key, k.dataDir), []);

    // Each step under the step timeout, together over the build's.
    const whole = await build(k, { name: "build-timeout", dockerfile: `FROM ${image}\n${["a", "b", "c", "d", "e"].map((s) => `RUN sleep 6; echo ${s}`).join("\n")}\n`, skip_cache: true });
    assert.equal(whole.events.at(-1)!.event, "error");
    assert.match(whole.events.at(-1)!.data.message, /the Dockerfile build ran longer than 20 s and was stopped/);
    assert.equal((await k.call("GET", "/health")).status, 200);
  } finally {
    await k.close();
  }
});

test("cancel kills the whole RUN tree before it answers; nothing of the build is left", { skip }, async () => {
  const k = await startTestKiln({ env: { KILN_INSECURE_REGISTRIES: reg.host, KILN_WARM_POOL: "0" }, waitForBase: false });
  try {
    const tag = 5000 + Math.floor(Math.random() * 900);
    const b = await startBuild(k.url, { name: "cancel-me", dockerfile: `FROM ${image}\n${sleeper(tag)}\n`, skip_cache: true });
    const key = await runningKey(tag);
    const c = await k.call("POST", `/v1/templates/${b.templateId}/builds/${b.buildId}/cancel`);
    assert.equal(c.status, 200, c.text);
    assert.equal(c.body.status, "cancelled");
    assert.deepEqual(tagged(tag), [], "when cancel answers, no process of the RUN tree is left");
    assert.deepEqual(leftovers(key, k.dataDir), [], "nor anything else of the build");
    await b.done;
    assert.equal(b.events().at(-1)!.event, "cancelled");
  } finally {
    await k.close();
  }
});

test("kill -9 of the server mid-RUN: the RUN tree dies with it, and the next start removes everything the build left", { skip }, async () => {
  const dataDir = await mkdtemp(join(tmpdir(), "kiln-build-kill9-"));
  const env = { ...process.env, KILN_DATA_DIR: dataDir, KILN_CACHE_DIR: TEST_CACHE_DIR, KILN_API_KEY: TEST_KEY, KILN_WARM_POOL: "0", KILN_INSECURE_REGISTRIES: reg.host };
  const serve = async () => {
    const port = await freePort();
    const child = spawn(KILN, ["serve", "--port", String(port)], { env, stdio: ["ignore", "ignore", process.env.KILN_TEST_SERVER_LOG ? openSync(process.env.KILN_TEST_SERVER_LOG, "a") : "ignore"] });
    const exited = new Promise<void>((resolve) => child.on("exit", () => resolve()));
    const url = `http://127.0.0.1:${port}`;
    await healthy(url);
    return { child, exited, url };
  };
  const first = await serve();
  let second: Awaited<ReturnType<typeof serve>> | undefined;
  try {
    const tag = 6000 + Math.floor(Math.random() * 900);
    const b = await startBuild(first.url, { name: `kill9-${randomBytes(3).toString("hex")}`, dockerfile: `FROM ${image}\n${sleeper(tag)}\n`, skip_cache: true });
    const key = await runningKey(tag);
    first.child.kill("SIGKILL");
    await first.exited;
    await until("the RUN tree to die with the server", () => tagged(tag).length === 0, 15_000);

    second = await serve();
    assert.deepEqual(leftovers(key, dataDir), [], "the next start removed the dead build's processes, mounts, namespaces, cgroups, egress rules and dirs");
    const rec = await request(`${second.url}/v1/templates/${b.templateId}/builds/${b.buildId}`, { headers: AUTH });
    const record = (await rec.body.json()) as { status: string; failure_phase: string };
    assert.equal(record.status, "error", "the interrupted build is recorded as failed");
  } finally {
    first.child.kill("SIGKILL");
    await first.exited;
    if (second) {
      second.child.kill("SIGTERM");
      await second.exited;
    }
    await rm(dataDir, { recursive: true, force: true });
  }
});
