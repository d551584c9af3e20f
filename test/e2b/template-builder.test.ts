// E2B's template builder through the published `e2b` SDK against a real Kiln: `Template().fromImage(...)` of an image on
// a loopback registry with runCmd + copy + setEnvs, `fromBaseImage()` with setStartCmd and a sandbox from the result,
// build logs with logsOffset, a failing runCmd as the SDK's BuildError, exists/tags; and hostile requests (a copy
// escaping its context, a huge upload, an unknown hash, forged upload links) that change nothing.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { mkdtemp, mkdir, writeFile, readdir, utimes } from "node:fs/promises";
import { Readable } from "node:stream";
import { existsSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { gzipSync } from "node:zlib";
import { spawnSync } from "node:child_process";
import { request } from "undici";
import { Sandbox, Template, BuildError, waitForFile } from "e2b";
import type { LogEntry } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { createE2bTemplateFiles } from "../../src/compat/e2b/templates.ts";
import { pushImage, registryAvailable, startRegistry, tarOf } from "../support/oci-registry.ts";
import type { TestRegistry } from "../support/oci-registry.ts";
import { hostArchSupported, shellRootfs } from "../support/mini-rootfs.ts";

const skip = registryAvailable() ?? (hostArchSupported() ? undefined : "x86-64 only");
const UPLOAD_LIMIT = 4 * 1024 * 1024;
let k: TestKiln;
let reg: TestRegistry;
let priv: TestRegistry;
const password = `pw-${randomBytes(10).toString("hex")}`;
let key: string;
let opts: { apiKey: string; apiUrl: string; sandboxUrl: string; requestTimeoutMs: number };
let ctx: string;
const machines: string[] = [];

before(async () => {
  if (skip) return;
  [reg, priv] = await Promise.all([startRegistry(), startRegistry({ auth: { username: "u", password } })]);
  const image = { layers: [{ entries: shellRootfs() }], config: { Env: ["FROM_IMAGE=yes"], WorkingDir: "/" } };
  await pushImage(reg, "mini/shell", "v1", image);
  await pushImage(priv, "mini/private", "v1", image);
  key = generateKeyIn("e2b");
  k = await startTestKiln({ env: { KILN_API_KEY: key, KILN_INSECURE_REGISTRIES: `${reg.host},${priv.host}`, KILN_BODY_LIMIT_BYTES: String(UPLOAD_LIMIT) } });
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 120_000 };
  ctx = await mkdtemp(join(tmpdir(), "e2b-tpl-ctx-"));
  await mkdir(join(ctx, "app", "lib"), { recursive: true });
  await writeFile(join(ctx, "hello.txt"), "hello from the context\n");
  await writeFile(join(ctx, "app", "main.sh"), "echo main\n", { mode: 0o755 });
  await writeFile(join(ctx, "app", "lib", "util.sh"), "echo util\n");
});

after(async () => {
  for (const id of machines) await k?.call("DELETE", `/v1/machines/${id}`, { key, settle: true });
  await k?.close();
  await reg?.stop();
  await priv?.stop();
});

async function exec(id: string, cmd: string): Promise<{ exit_code: number; stdout: string }> {
  const r = await k.call("POST", `/v1/machines/${id}/exec`, { key, body: { cmd } });
  assert.equal(r.status, 200, r.text);
  return r.body;
}

async function machineFrom(template: string): Promise<string> {
  const r = await k.call("POST", "/v1/machines", { key, body: { template } });
  assert.equal(r.status, 201, r.text);
  machines.push(r.body.id);
  return r.body.id;
}

async function buildCount(): Promise<number> {
  const r = await k.call("GET", "/v1/templates", { key });
  let n = 0;
  for (const t of r.body.templates) {
    const b = await k.call("GET", `/v1/templates/${t.template_id}/builds`, { key });
    assert.equal(b.status, 200, b.text);
    n += b.body.builds.length;
  }
  return n;
}

test("Template().fromImage(registry image) with runCmd, copy and setEnvs builds a Kiln template; its build log reaches onBuildLogs", { skip }, async () => {
  const logs: LogEntry[] = [];
  const tpl = Template({ fileContextPath: ctx })
    .fromImage(`${reg.host}/mini/shell:v1`)
    .setEnvs({ GREETING: "hi there" })
    .runCmd('echo "built $GREETING $FROM_IMAGE" > /built.txt')
    .copy("hello.txt", "/data/")
    .copy("app", "/opt/app", { mode: 0o750 });
  const info = await Template.build(tpl, "e2b-mini:v1", { ...opts, onBuildLogs: (e) => logs.push(e) });
  assert.match(info.templateId, /^tpl_/);
  assert.deepEqual(info.tags, ["v1"]);
  const messages = logs.map((e) => e.message).join("\n");
  assert.match(messages, /Uploaded 'hello\.txt'/);
  assert.match(messages, /step \d\/4/, "Kiln's step lines come through the status polls");

  const id = await machineFrom("e2b-mini:v1");
  assert.equal((await exec(id, "cat /built.txt")).stdout, "built hi there yes\n");
  assert.equal((await exec(id, "cat /data/hello.txt /opt/app/main.sh /opt/app/lib/util.sh")).stdout, "hello from the context\necho main\necho util\n");

  // The same files again: the SDK is told they are present and uploads nothing.
  const again: LogEntry[] = [];
  await Template.build(Template({ fileContextPath: ctx }).fromImage(`${reg.host}/mini/shell:v1`).copy("hello.txt", "/data/"), "e2b-mini-two", { ...opts, onBuildLogs: (e) => again.push(e) });
  assert.match(again.map((e) => e.message).join("\n"), /Skipping upload of 'hello\.txt', already cached/);

  // fromTemplate builds on the Kiln template just made.
  await Template.build(Template().fromTemplate("e2b-mini:v1").runCmd("cat /built.txt > /again"), "e2b-mini-child", opts);
  const child = await machineFrom("e2b-mini-child");
  assert.equal((await exec(child, "cat /again /data/hello.txt")).stdout, "built hi there yes\nhello from the context\n");

  // Uploaded files are private.
  const dir = join(k.dataDir, "e2b-template-files");
  const { statSync } = await import("node:fs");
  assert.equal(statSync(dir).mode & 0o777, 0o700);
  for (const f of await readdir(dir)) assert.equal(statSync(join(dir, f)).mode & 0o077, 0, f);
});

test("fromBaseImage() with setStartCmd/readyCmd: Sandbox.create(alias) runs the start command; exists and tags see the template", { skip }, async () => {
  const tpl = Template({ fileContextPath: ctx })
    .fromBaseImage()
    .copy("hello.txt", "/home/user/hello.txt", { user: "user" })
    .runCmd("echo from-run > /etc/e2b-run")
    .makeDir("/opt/made", { mode: 0o700 })
    .makeSymlink("/etc/e2b-run", "/opt/made/link")
    .setStartCmd("bash -c 'echo started > /tmp/started; exec sleep infinity'", waitForFile("/tmp/started"));
  assert.equal(await Template.exists("e2b-started", opts), false);
  const info = await Template.build(tpl, { alias: "e2b-started", ...opts });
  assert.equal(await Template.exists("e2b-started", opts), true);
  assert.equal(await Template.exists("e2b-started:default", opts), true);
  const tags = await Template.getTags(info.templateId, opts);
  assert.deepEqual(tags.map((t) => [t.tag, t.buildId]), [["default", info.buildId]]);

  const sbx = await Sandbox.create("e2b-started", { ...opts, timeoutMs: 120_000 });
  try {
    assert.equal((await sbx.commands.run("cat /tmp/started /etc/e2b-run ~/hello.txt")).stdout, "started\nfrom-run\nhello from the context\n");
    assert.equal((await sbx.commands.run("stat -c %U ~/hello.txt")).stdout.trim(), "user");
    assert.equal((await sbx.commands.run("stat -c %a /opt/made; readlink /opt/made/link", { user: "root" })).stdout, "700\n/etc/e2b-run\n");
  } finally {
    await sbx.kill();
  }
});

test("fromDockerfile: the SDK parses the Dockerfile into steps, which Kiln builds (RUN, ENV, WORKDIR, USER)", { skip }, async () => {
  const dockerfile = "FROM e2bdev/base\nENV DF_GREETING=from-dockerfile\nRUN echo \"$DF_GREETING\" > /df.txt\nWORKDIR /srv/app\nRUN pwd > /df-pwd.txt\n";
  await Template.build(Template().fromDockerfile(dockerfile), "e2b-dockerfile", opts);
  const id = await machineFrom("e2b-dockerfile");
  assert.equal((await exec(id, "cat /df.txt /df-pwd.txt")).stdout, "from-dockerfile\n/srv/app\n");
  const v = await k.call("GET", "/v1/templates/e2b-dockerfile", { key });
  assert.equal(v.status, 200, v.text);
});

test("buildInBackground + getBuildStatus: logsOffset pages through the durable log without repeats; a failing runCmd is a BuildError with Kiln's message", { skip }, async () => {
  const tpl = Template().fromBaseImage().runCmd("echo before-fail").runCmd("echo going-down >&2; exit 3");
  const data = await Template.buildInBackground(tpl, "e2b-fails", opts);
  let offset = 0;
  const seen: string[] = [];
  let status = "building";
  for (let i = 0; i < 600 && (status === "building" || status === "waiting"); i++) {
    const s = await Template.getBuildStatus(data, { ...opts, logsOffset: offset });
    offset += s.logEntries.length;
    seen.push(...s.logEntries.map((e) => e.message));
    status = s.status;
    if (status === "error") {
      assert.match(s.reason!.message, /^step 2\/2 \(.*\) exited with code 3: going-down/);
      assert.equal(s.reason!.step, "2");
    }
    if (s.logEntries.length === 0) await new Promise((r) => setTimeout(r, 200));
  }
  assert.equal(status, "error");
  const rest = await Template.getBuildStatus(data, { ...opts, logsOffset: offset });
  seen.push(...rest.logEntries.map((e) => e.message));
  assert.equal(seen.filter((m) => m === "before-fail").length, 1, `the step's output line, once: ${JSON.stringify(seen)}`);
  assert.equal(seen.filter((m) => /^step 1\/2:/.test(m)).length, 1, "each entry once");
  const all = await Template.getBuildStatus(data, { ...opts, logsOffset: 0 });
  assert.equal(all.logEntries[0].message, seen[0]);

  await assert.rejects(Template.build(tpl, "e2b-fails", opts), (err: unknown) => {
    assert.ok(err instanceof BuildError, String(err));
    assert.match((err as Error).message, /step 2\/2 \(.*\) exited with code 3: going-down/);
    return true;
  });
});

test("fromImage(private image, {username, password}) pulls with the registry's credentials; the password is stored and logged nowhere", { skip }, async () => {
  await assert.rejects(Template.build(Template().fromImage(`${priv.host}/mini/private:v1`).runCmd("echo x > /x"), "e2b-private-denied", opts), BuildError);
  const tpl = Template().fromImage(`${priv.host}/mini/private:v1`, { username: "u", password }).runCmd("echo private-ok > /ok");
  await Template.build(tpl, "e2b-private", opts);
  const id = await machineFrom("e2b-private");
  assert.equal((await exec(id, "cat /ok")).stdout, "private-ok\n");
  assert.equal(spawnSync("grep", ["-rlaF", "--exclude=disk.img", "--exclude=image.ext4", "--exclude=disks.xfs", "--exclude-dir=disks", password, k.dataDir]).stdout.toString(), "", "the password is nowhere in the data dir");
  assert.ok(!k.logs.join("").includes(password), "nor in the server's logs");
});

test("uploaded template files unused for the retention period are removed; young ones stay", async () => {
  const dir = await mkdtemp(join(tmpdir(), "e2b-tpl-files-"));
  const files = createE2bTemplateFiles(dir, 1024);
  const old = "a".repeat(64);
  const young = "b".repeat(64);
  await files.put(old, Readable.from([Buffer.from("old")]));
  await files.put(young, Readable.from([Buffer.from("young")]));
  const past = new Date(Date.now() - 7200_000);
  await utimes(join(files.dir, old), past, past);
  assert.equal(await files.collect(3600), 1);
  assert.deepEqual([await files.present(old), await files.present(young)], [false, true]);
  await assert.rejects(files.put("c".repeat(64), Readable.from([Buffer.alloc(2048)])), /at most 1024 bytes/);
  assert.equal(await files.present("c".repeat(64)), false);
  assert.deepEqual((await readdir(files.dir)).sort(), [young], "no partial upload left behind");
});

/** The SDK's first two calls by hand: a requested build and an upload link. */
async function requestBuild(name: string): Promise<{ templateID: string; buildID: string }> {
  const r = await k.call("POST", "/v3/templates", { key, body: { name } });
  assert.equal(r.status, 202, r.text);
  return r.body;
}

async function uploadLink(templateID: string, hash: string): Promise<{ present: boolean; url: string }> {
  const r = await k.call("GET", `/templates/${templateID}/files/${hash}`, { key });
  assert.equal(r.status, 200, r.text);
  return r.body;
}

async function put(url: string, body: Buffer): Promise<{ status: number; text: string }> {
  const res = await request(url, { method: "PUT", body });
  return { status: res.statusCode, text: await res.body.text() };
}

test("hostile template builds change nothing: a copy escaping its context, a tar entry climbing out, a huge upload, an unknown hash, forged links", { skip }, async () => {
  const before = await buildCount();
  const { templateID, buildID } = await requestBuild("e2b-hostile");
  const start = (steps: unknown[]) => k.call("POST", `/v2/templates/${templateID}/builds/${buildID}`, { key, body: { fromImage: "e2bdev/base", steps } });

  // A copy source outside the context (the SDK refuses it client-side; a hand-made request gets 400).
  const hash = createHash("sha256").update(randomBytes(16)).digest("hex");
  let r = await start([{ type: "COPY", args: ["../../etc/passwd", "/x", "", ""], filesHash: hash }]);
  assert.equal(r.status, 400, r.text);
  assert.match(r.body.message, /outside the copy's context/);

  // An unknown hash: nothing was uploaded for it.
  r = await start([{ type: "COPY", args: ["a.txt", "/x", "", ""], filesHash: hash }]);
  assert.equal(r.status, 400, r.text);
  assert.match(r.body.message, /No files were uploaded for hash/);

  // A tar whose entry climbs out of the context.
  const link = await uploadLink(templateID, hash);
  assert.equal(link.present, false);
  const evil = gzipSync(await tarOf([{ name: "../../escaped.txt", content: "pwned\n" }]));
  assert.equal((await put(link.url, evil)).status, 200);
  r = await start([{ type: "COPY", args: ["a.txt", "/x", "", ""], filesHash: hash }]);
  assert.equal(r.status, 400, r.text);
  assert.match(r.body.message, /outside the copy's context/);
  assert.equal(existsSync(join(k.dataDir, "escaped.txt")) || existsSync(join(k.dataDir, "blobs", "..", "..", "escaped.txt")), false);

  // An unknown step type and an invalid env name are refused before anything runs.
  r = await start([{ type: "HEALTHCHECK", args: ["x"] }]);
  assert.equal(r.status, 400, r.text);
  r = await start([{ type: "ENV", args: ["BAD NAME", "x"] }]);
  assert.equal(r.status, 400, r.text);
  assert.match(r.body.message, /step 1 \(ENV\): "BAD NAME" is not an environment variable name/);
  r = await start([{ type: "WORKDIR", args: ["relative/dir"] }]);
  assert.equal(r.status, 400, r.text);
  assert.match(r.body.message, /Invalid template: step 1/);

  // A huge upload: refused by its declared length, and while it streams; nothing is kept.
  const hash2 = createHash("sha256").update(randomBytes(16)).digest("hex");
  const link2 = await uploadLink(templateID, hash2);
  const huge = await put(link2.url, randomBytes(UPLOAD_LIMIT + 1024));
  assert.equal(huge.status, 413, huge.text);
  assert.equal((await uploadLink(templateID, hash2)).present, false);

  // Forged, expired, foreign-key and unsigned links: 401, nothing stored.
  const u = new URL(link2.url);
  const forged = new URL(u);
  forged.searchParams.set("signature", "A".repeat(43));
  assert.equal((await put(forged.toString(), Buffer.from("x"))).status, 401);
  const expired = new URL(u);
  expired.searchParams.set("expires", "1");
  assert.equal((await put(expired.toString(), Buffer.from("x"))).status, 401);
  const otherHash = new URL(u.toString().replace(hash2, "f".repeat(64)));
  assert.equal((await put(otherHash.toString(), Buffer.from("x"))).status, 401);
  assert.equal((await put(`${u.origin}${u.pathname}`, Buffer.from("x"))).status, 401);
  assert.equal((await uploadLink(templateID, hash2)).present, false);
  assert.equal((await uploadLink(templateID, "f".repeat(64))).present, false);

  // No key, no link; a build id never requested is not found.
  assert.equal((await k.call("GET", `/templates/${templateID}/files/${hash}`, { key: null })).status, 401);
  assert.equal((await k.call("POST", `/v2/templates/${templateID}/builds/bld_nope`, { key, body: { steps: [] } })).status, 404);
  assert.equal(await buildCount(), before, "no build was recorded");
  // The requested build is still startable after all that.
  const s = await k.call("GET", `/templates/${templateID}/builds/${buildID}/status`, { key });
  assert.equal(s.body.status, "waiting");
});
