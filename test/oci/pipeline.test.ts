// Image imports and Dockerfile builds through POST /v1/templates/build, seen from outside: the SSE log (progress,
// layer cache entries, builder output, build_error), machines from the resulting templates, and credentials and
// secrets absent from the data dir and the server's logs.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { spawnSync } from "node:child_process";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { request } from "undici";
import { TEST_KEY } from "../support/kiln.ts";
import { pushImage, registryAvailable, startRegistry } from "../support/oci-registry.ts";
import type { TestRegistry } from "../support/oci-registry.ts";
import { hostArchSupported, shellRootfs } from "../support/mini-rootfs.ts";

interface SseEvent {
  event: string;
  data: any;
}

async function build(kiln: TestKiln, body: unknown): Promise<{ status: number; envelope?: any; events: SseEvent[] }> {
  const res = await request(kiln.url + "/v1/templates/build", { method: "POST", headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" }, body: JSON.stringify(body) });
  const text = await res.body.text();
  if (res.statusCode !== 200) return { status: res.statusCode, envelope: JSON.parse(text), events: [] };
  const events = text
    .split("\n\n")
    .map((block) => ({ event: /^event: (.*)$/m.exec(block)?.[1] ?? "", data: /^data: (.*)$/m.exec(block)?.[1] }))
    .filter((e) => e.data)
    .map((e) => ({ event: e.event, data: JSON.parse(e.data!) }));
  return { status: 200, events };
}

async function buildOk(kiln: TestKiln, body: unknown): Promise<{ events: SseEvent[] }> {
  const r = await build(kiln, body);
  assert.equal(r.status, 200, JSON.stringify(r.envelope));
  assert.equal(r.events.at(-1)?.event, "end", JSON.stringify(r.events.slice(-3)));
  return r;
}

async function putBlob(kiln: TestKiln, content: string): Promise<string> {
  const sha = createHash("sha256").update(content).digest("hex");
  const r = await kiln.call("PUT", `/v1/templates/blobs/${sha}`, { raw: Buffer.from(content), headers: { "content-type": "application/octet-stream" } });
  assert.ok(r.status === 200 || r.status === 201, r.text);
  return sha;
}

async function machineFrom(kiln: TestKiln, template: string): Promise<string> {
  const r = await kiln.call("POST", "/v1/machines", { body: { template } });
  assert.equal(r.status, 201, r.text);
  machines.push(r.body.id);
  return r.body.id;
}

async function sh(kiln: TestKiln, id: string, cmd: string): Promise<{ exit_code: number; stdout: string }> {
  const r = await kiln.call("POST", `/v1/machines/${id}/exec`, { body: { cmd } });
  assert.equal(r.status, 200, r.text);
  return r.body;
}

const machines: string[] = [];

const skip = registryAvailable() ?? (hostArchSupported() ? undefined : "x86-64 only");
const opt = { skip };

const password = `pw-${randomBytes(10).toString("hex")}`;
let reg: TestRegistry;
let priv: TestRegistry;
let k: TestKiln;

before(async () => {
  if (skip) return;
  [reg, priv] = await Promise.all([startRegistry(), startRegistry({ auth: { username: "u", password } })]);
  const image = { layers: [{ entries: shellRootfs() }, { entries: [{ name: "etc/motd", content: "imported\n" }, { name: "run-marker", content: randomBytes(8).toString("hex") }] }], config: { Env: ["FROM_IMAGE=yes"], WorkingDir: "/" } };
  await pushImage(reg, "mini/shell", "v1", image);
  await pushImage(priv, "mini/private", "v1", image);
  k = await startTestKiln({ env: { KILN_INSECURE_REGISTRIES: `${reg.host},${priv.host}` } });
});

after(async () => {
  if (skip) return;
  for (const id of machines) await k?.call("DELETE", `/v1/machines/${id}`);
  await k?.close();
  await Promise.all([reg?.stop(), priv?.stop()]);
});

test("base_image import with declarative steps on top in one build; a machine from it runs commands", opt, async () => {
  const { events } = await buildOk(k, { name: "imported-mini", base_image: `${reg.host}/mini/shell:v1`, steps: [{ type: "run", command: "cat /etc/motd > /from-step" }] });
  const layerEntries = events.filter((e) => e.data.cache_layer === "layer" && /image layer/.test(e.data.cache_target ?? ""));
  const outcomes = layerEntries.map((e) => e.data.cache_outcome);
  assert.equal(outcomes.filter((o) => o === "hit" || o === "miss").length, 2, `one lookup per image layer: ${outcomes}`);
  assert.ok(outcomes.includes("miss") && outcomes.includes("stored"), `the new layer is a miss, then stored: ${outcomes}`);
  assert.ok(events.some((e) => e.event === "message" && /layer 2\/2/.test(e.data.message)), "download progress in the log");
  const id = await machineFrom(k, "imported-mini");
  assert.equal((await sh(k, id, "cat /from-step")).stdout, "imported\n");
  assert.equal((await sh(k, id, "echo $FROM_IMAGE")).stdout, "yes\n");
  const again = await buildOk(k, { name: "imported-mini-2", base_image: `${reg.host}/mini/shell:v1` });
  assert.deepEqual(again.events.filter((e) => e.data.cache_layer === "layer" && /image layer/.test(e.data.cache_target ?? "")).map((e) => e.data.cache_outcome), ["hit", "hit"]);
});

test("an unsupported manifest ends the stream with build_error naming it; credentials are never stored or logged", opt, async () => {
  await pushImage(reg, "mini/features", "v1", { layers: [{ entries: [{ name: "x", content: "x" }] }], extraConfig: { "os.features": ["win32k"] } });
  const r = await build(k, { name: "bad-features", base_image: `${reg.host}/mini/features:v1` });
  const last = r.events.at(-1)!;
  assert.equal(last.event, "error");
  assert.equal(last.data.error_detail.code, "build_error");
  assert.match(last.data.message, /os\.features/);
  await buildOk(k, { name: "private-mini", base_image: `${priv.host}/mini/private:v1`, base_image_auth: { type: "basic", username: "u", password } });
  const denied = await build(k, { name: "private-denied", base_image: `${priv.host}/mini/private:v1` });
  assert.equal(denied.events.at(-1)!.data.error_detail.code, "build_error");
  assert.equal(spawnSync("grep", ["-rlaF", "--exclude=disk.img", "--exclude=image.ext4", "--exclude=disks.xfs", "--exclude-dir=disks", password, k.dataDir]).stdout.toString(), "", "the password is nowhere in the data dir");
  assert.ok(!k.logs.join("").includes(password), "nor in the server's logs");
});

test("a Dockerfile build through the endpoint: secret mount, build args, target, COPY from the context, FROM a Kiln template; the secret is nowhere", opt, async () => {
  const secret = `sec-${randomBytes(10).toString("hex")}`;
  const dockerfile = `FROM imported-mini AS base\nARG WHO=nobody\nRUN echo "hello $WHO" > /hello\nCOPY app.txt /app.txt\nRUN --mount=type=secret,id=tok read s < /run/secrets/tok; echo \${#s} > /len\nFROM base AS final\nRUN echo final > /final\nFROM base AS unused\nRUN echo unused > /unused\n`;
  const appSha = await putBlob(k, "from the context\n");
  const { events } = await buildOk(k, {
    name: "from-dockerfile",
    dockerfile,
    build_args: { WHO: "kiln" },
    target: "final",
    secrets: [{ id: "tok", value: secret }],
    context: { files: [{ path: "app.txt", sha256: appSha }] },
  });
  assert.ok(events.some((e) => e.event === "message" && /STEP/.test(e.data.message)), "the builder's output is in the log");
  assert.match(events.find((e) => e.event === "start")!.data.message, /with 9 steps/, "the start line counts the Dockerfile's instructions");
  const stepLine = events.find((e) => e.event === "message" && /^(\[\d+\/\d+\] )?STEP \d+\/\d+: RUN echo final/.test(e.data.message));
  assert.equal(stepLine?.data.phase, "step", `the builder's steps are in phase step: ${JSON.stringify(events.filter((e) => /STEP|final/.test(e.data.message ?? "")).map((e) => [e.data.phase, e.data.message]))}`);
  assert.ok(Number.isInteger(stepLine?.data.step_index) && stepLine!.data.total_steps === 9, "with their index through the whole file");
  assert.ok(events.some((e) => e.event === "message" && /goes to the Dockerfile builder \(it uses secrets\)/.test(e.data.message)), "the log says why the builder runs it");
  const id = await machineFrom(k, "from-dockerfile");
  assert.equal((await sh(k, id, "cat /hello /app.txt /final /etc/motd")).stdout, "hello kiln\nfrom the context\nfinal\nimported\n");
  assert.equal((await sh(k, id, "cat /len")).stdout.trim(), String(secret.length));
  assert.equal((await sh(k, id, "test -e /unused && echo present || echo absent")).stdout, "absent\n");
  assert.equal(spawnSync("grep", ["-rlaF", "--exclude=disk.img", "--exclude=image.ext4", "--exclude=disks.xfs", "--exclude-dir=disks", secret, k.dataDir]).stdout.toString(), "", "the secret is nowhere in the data dir (records, logs, builder storage)");
  assert.ok(!k.logs.join("").includes(secret), "nor in the server's logs");
  const bad = await build(k, { name: "df-bad", dockerfile: "FROM alpine\n", registry_credentials: [{ registry: "ghcr.io", username: "u", password: "p" }] });
  assert.equal(bad.status, 400, "credentials for a registry the Dockerfile does not use are refused before the stream");
  assert.match(bad.envelope.error, /ghcr\.io/);
});
