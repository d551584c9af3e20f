// GET /metrics after real traffic: behind the API key, Prometheus text format that Debian's promtool accepts and a
// real Prometheus scrapes with its bearer setting; machines by status and host, create and exec latencies, warm
// pool takes, admission refusals, builds by status, webhook backlog and attempt latency, edge requests.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startReceiver } from "../webhooks/receiver.ts";
import type { Receiver } from "../webhooks/receiver.ts";
import { freePort } from "../support/net.ts";
import { buildOk } from "../builds/support.ts";

let k: TestKiln;
let receiver: Receiver;
let machineId: string;
before(async () => {
  receiver = await startReceiver();
  k = await startTestKiln({ env: { KILN_WEBHOOK_ALLOW_PRIVATE: "1", KILN_WARM_POOL: "1" } });
  // Real traffic: a webhook, a machine (its create event delivered), two execs, a refused create, an edge request.
  const hook = await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: `${receiver.url}/hook`, operations: ["create"], signing_secret: "whsec_" + Buffer.from("metrics-test-secret-0123456789ab").toString("base64") } });
  assert.equal(hook.status, 201, hook.text);
  const m = await k.call("POST", "/v1/machines", { body: {} });
  assert.equal(m.status, 201, m.text);
  machineId = m.body.id;
  for (const cmd of ["true", "exit 2"]) assert.equal((await k.call("POST", `/v1/machines/${machineId}/exec`, { body: { cmd } })).status, 200);
  assert.equal((await k.call("POST", "/v1/machines", { body: { vcpus: 100000 } })).status, 400);
  await (await request(`${k.url}/edge/svc_unknown/`)).body.dump();
  await receiver.waitFor((r) => r.path === "/hook");
});
after(async () => {
  await k?.close();
  await receiver?.close();
});

async function scrape(key: string | null = TEST_KEY): Promise<{ status: number; type: string; text: string }> {
  const res = await k.call("GET", "/metrics", { key });
  return { status: res.status, type: String(res.headers["content-type"]), text: res.text };
}

/** The value of one sample line (`name{labels} value`), or undefined. */
function sample(text: string, name: string, labels: Record<string, string> = {}): number | undefined {
  for (const line of text.split("\n")) {
    if (!line.startsWith(name + "{") && !line.startsWith(name + " ")) continue;
    const brace = line.startsWith(name + "{") ? line.slice(name.length + 1, line.indexOf("}")) : "";
    const have = Object.fromEntries([...brace.matchAll(/(\w+)="([^"]*)"/g)].map((m) => [m[1], m[2]]));
    if (Object.entries(labels).every(([k2, v]) => have[k2] === v)) return Number(line.slice(line.lastIndexOf(" ") + 1));
  }
  return undefined;
}

test("GET /metrics needs the API key: without it 401 with the envelope", async () => {
  const res = await scrape(null);
  assert.equal(res.status, 401);
  assert.equal(JSON.parse(res.text).code, "unauthorized");
});

test("after real traffic, /metrics reports machines, latencies, the warm pool, refusals, builds, webhooks and the edge", async () => {
  // The delivery's attempt is recorded just after the receiver answered it: wait for the delivery's own record.
  const hooks = (await k.call("GET", "/v1/lifecycle/webhooks")).body;
  const hookId = (hooks.webhooks ?? hooks)[0].id;
  for (let i = 0; i < 100; i++) {
    const d = (await k.call("GET", `/v1/lifecycle/webhooks/${hookId}/deliveries`)).body;
    if ((d.deliveries ?? d).some((x: { status: string }) => x.status === "succeeded")) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  const { status, type, text } = await scrape();
  assert.equal(status, 200);
  assert.match(type, /^text\/plain; version=0\.0\.4/);
  const machines = text.split("\n").filter((l) => l.startsWith("kiln_machines{"));
  assert.deepEqual(machines.map((l) => l.replace(/"host_[0-9a-z]+"/, "\"HOST\"")), ['kiln_machines{status="running",host_id="HOST"} 1'], "one running machine, on this host");
  assert.equal(sample(text, "kiln_machine_create_duration_seconds_count", { outcome: "ok" }), 1);
  assert.equal(sample(text, "kiln_machine_create_duration_seconds_count", { outcome: "error" }), 1);
  assert.equal(sample(text, "kiln_exec_duration_seconds_count", { outcome: "ok" }), 2, "an exit code is a successful exec");
  assert.ok(sample(text, "kiln_exec_duration_seconds_sum", { outcome: "ok" })! > 0);
  assert.equal(sample(text, "kiln_http_request_duration_seconds_count", { method: "POST", route: "/v1/machines/:id/exec", status: "200" }), 2);
  assert.equal(sample(text, "kiln_warm_pool_size"), 1);
  const hits = sample(text, "kiln_warm_pool_takes_total", { outcome: "hit" })!;
  const misses = sample(text, "kiln_warm_pool_takes_total", { outcome: "miss" })!;
  assert.equal(hits + misses, 1, "the one create asked the pool once");
  assert.equal(sample(text, "kiln_admission_refusals_total", { reason: "memory" }), 0);
  assert.equal(sample(text, "kiln_builds", { status: "ready" }), 0);
  assert.equal(sample(text, "kiln_webhook_backlog"), 0);
  assert.equal(sample(text, "kiln_webhook_attempt_duration_seconds_count", { outcome: "ok" }), 1);
  assert.equal(sample(text, "kiln_edge_request_duration_seconds_count", { status: "4xx" }), 1);
  assert.ok(sample(text, "kiln_process_resident_memory_bytes")! > 0);
  // No secret of the traffic above is in the exposition.
  assert.ok(!text.includes(TEST_KEY) && !text.includes("metrics-test-secret"));
});

test("a create refused for want of memory is counted by reason", async () => {
  const tight = await startTestKiln({ env: { KILN_MIN_FREE_MEMORY_MB: String(1024 * 1024 * 1024) } });
  try {
    const refused = await tight.call("POST", "/v1/machines", { body: {} });
    assert.equal(refused.status, 503);
    const text = (await tight.call("GET", "/metrics")).text;
    assert.equal(sample(text, "kiln_admission_refusals_total", { reason: "memory" }), 1);
    assert.equal(sample(text, "kiln_machine_create_duration_seconds_count", { outcome: "error" }), 1);
  } finally {
    await tight.close();
  }
});

test("a hot template's pool is in /metrics and GET /v1/ready (size, ready, takes), and only while it has one", async () => {
  const hot = await startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_HOT_POOL_AFTER: "1", KILN_HOT_POOL_MAX: "1", KILN_HOT_POOL_TOTAL: "1" } });
  try {
    const { artifactId } = await buildOk(hot, { name: "hot-metrics", steps: [{ type: "run", command: "echo hot > /hot-mark" }] });
    const ready = async () => {
      const r = await hot.call("GET", "/v1/ready");
      assert.equal(r.status, 200, r.text);
      return r.body.pools;
    };
    const scrapeHot = async () => (await hot.call("GET", "/metrics")).text;
    // No template is hot yet: no series, nothing in readiness (the base template's pool is reported on its own).
    assert.deepEqual(await ready(), { warm: { size: 0, ready: 0, booting: 0 }, hot: [] });
    assert.ok(!/^kiln_hot_pool_/m.test(await scrapeHot()), "no hot pool series before any template has a pool");
    // The first create makes the template hot; nothing of its pool was ready for it: a miss.
    const first = await hot.call("POST", "/v1/machines", { body: { template: "hot-metrics" } });
    assert.equal(first.status, 201, first.text);
    const deadline = Date.now() + 120_000;
    let pools = await ready();
    while (!(pools.hot[0]?.ready >= 1)) {
      if (Date.now() > deadline) throw new Error(`the hot pool did not fill: ${JSON.stringify(pools)}`);
      await new Promise((r) => setTimeout(r, 50));
      pools = await ready();
    }
    assert.deepEqual(pools.hot, [{ template: "local/hot-metrics", artifact_id: artifactId, size: 1, ready: 1, booting: 0, takes: { hit: 0, miss: 1 } }]);
    // The next one takes the pooled machine: a hit.
    const second = await hot.call("POST", "/v1/machines", { body: { template: "hot-metrics" } });
    assert.equal(second.status, 201, second.text);
    assert.equal((await hot.call("POST", `/v1/machines/${second.body.id}/exec`, { body: { cmd: "cat /hot-mark" } })).body.stdout, "hot\n");
    const after = (await ready()).hot;
    assert.equal(after.length, 1);
    assert.deepEqual(after[0].takes, { hit: 1, miss: 1 });
    const text = await scrapeHot();
    const labels = { template: "local/hot-metrics", artifact_id: artifactId };
    assert.equal(sample(text, "kiln_hot_pool_size", labels), 1);
    assert.equal(sample(text, "kiln_hot_pool_ready", labels), after[0].ready);
    assert.equal(sample(text, "kiln_hot_pool_takes_total", { ...labels, outcome: "hit" }), 1);
    assert.equal(sample(text, "kiln_hot_pool_takes_total", { ...labels, outcome: "miss" }), 1);
    // Labels are bounded: the pooled template's, nothing else (not the base template, not other artifacts).
    const series = text.split("\n").filter((l) => /^kiln_hot_pool_\w+\{/.test(l));
    assert.equal(series.length, 4, series.join("\n"));
    assert.ok(series.every((l) => l.includes(`template="local/hot-metrics",artifact_id="${artifactId}"`)), series.join("\n"));
    for (const id of [first.body.id, second.body.id]) assert.equal((await hot.call("DELETE", `/v1/machines/${id}`)).status, 200);
  } finally {
    await hot.close();
  }
});

test("Debian's promtool accepts the exposition", async () => {
  const { text } = await scrape();
  const lint = spawnSync("promtool", ["check", "metrics"], { input: text, encoding: "utf8" });
  // Exit 1 is a format error; 3 is lint advice. The only advice allowed is about three gauges prom-client's default
  // Node collectors name with `_total` (not ours to rename).
  assert.notEqual(lint.status, 1, lint.stderr);
  const advice = (lint.stdout + lint.stderr).split("\n").filter((l) => l.trim());
  assert.deepEqual(advice.filter((l) => !/^kiln_nodejs_active_(handles|requests|resources)_total non-counter metrics should not have "_total" suffix$/.test(l)), []);
});

test("a real Prometheus scrapes /metrics with its bearer setting and can query what Kiln reports", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-prometheus-"));
  let prom: ChildProcess | undefined;
  try {
    await writeFile(join(dir, "key"), TEST_KEY, { mode: 0o600 });
    const target = new URL(k.url).host;
    // The README's scrape config, with the key in a file.
    await writeFile(
      join(dir, "prometheus.yml"),
      ["global:", "  scrape_interval: 1s", "scrape_configs:", "  - job_name: kiln", "    authorization:", `      credentials_file: ${join(dir, "key")}`, "    static_configs:", `      - targets: ["${target}"]`, ""].join("\n"),
    );
    const port = await freePort();
    prom = spawn("prometheus", [`--config.file=${join(dir, "prometheus.yml")}`, `--storage.tsdb.path=${join(dir, "data")}`, `--web.listen-address=127.0.0.1:${port}`], { stdio: "ignore" });
    const exited = new Promise<void>((resolve) => prom!.once("exit", () => resolve()));
    const query = async (q: string) => {
      const res = await request(`http://127.0.0.1:${port}/api/v1/query?query=${encodeURIComponent(q)}`);
      return (await res.body.json()) as { data: { result: { value: [number, string] }[] } };
    };
    // Bounded wait for the first scrape (Prometheus starts, then scrapes every second).
    let running: number | undefined;
    for (let i = 0; i < 150 && running === undefined; i++) {
      const answer = await query('sum(kiln_machines{status="running"})').catch(() => undefined);
      const value = answer?.data.result[0]?.value[1];
      if (value !== undefined) running = Number(value);
      else await new Promise((r) => setTimeout(r, 200));
    }
    assert.equal(running, 1);
    const up = await query('up{job="kiln"}');
    assert.equal(up.data.result[0]?.value[1], "1");
    const execs = await query('sum(kiln_exec_duration_seconds_count{outcome="ok"})');
    assert.equal(Number(execs.data.result[0]?.value[1]), 2);
    prom.kill("SIGTERM");
    await exited;
    prom = undefined;
  } finally {
    prom?.kill("SIGKILL");
    await rm(dir, { recursive: true, force: true });
  }
});
