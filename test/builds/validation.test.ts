// Before the stream: every validation rule answers an HTTP error envelope, starts no stream and changes nothing;
// context blobs; name precedence, name claims and aliases (including the aliases/aliases rule).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { build, buildOk, putBlob, sha256hex } from "./support.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

async function refused(body: unknown, status: number, code: string, match?: RegExp) {
  const r = await build(k, body);
  assert.equal(r.status, status, r.raw);
  assert.equal(r.envelope.code, code);
  assert.match(r.envelope.request_id, /^req_/);
  if (match) assert.match(r.envelope.error, match);
  assert.equal(r.events.length, 0, "no stream started");
  return r.envelope;
}

async function templateNames(): Promise<string[]> {
  const r = await k.call("GET", "/v1/templates");
  assert.equal(r.status, 200, r.text);
  return r.body.templates.map((t: { canonical_ref: string }) => t.canonical_ref);
}

test("an explicitly empty tags array is invalid; omitted tags mean [\"default\"]", async () => {
  await refused({ name: "empty-tags", tags: [] }, 400, "invalid_request");
  assert.ok(!(await templateNames()).includes("local/empty-tags"), "nothing was created");
  const ok = await buildOk(k, { name: "default-tags" });
  const rec = await k.call("GET", `/v1/templates/default-tags/builds/${ok.buildId}`);
  assert.deepEqual(rec.body.tags, ["default"]);
});

test("unknown fields are rejected, at the top and inside steps", async () => {
  await refused({ name: "x", colour: "blue" }, 400, "invalid_request");
  await refused({ name: "x", steps: [{ type: "run", command: "true", shell: "bash" }] }, 400, "invalid_request");
  await refused({ name: "x", steps: [{ type: "teleport" }] }, 400, "invalid_request");
  await refused({ name: "x", vm: { gpus: 1 } }, 400, "invalid_request");
});

test("env and build-arg names must be names, wherever they appear", async () => {
  for (const bad of ["1BAD", "A-B", "A B", ""]) {
    await refused({ name: "bad-env", envs: { [bad]: "x" } }, 400, "invalid_request");
    await refused({ name: "bad-env", build_args: { [bad]: "x" } }, 400, "invalid_request");
    await refused({ name: "bad-env", steps: [{ type: "env", envs: { [bad]: "x" } }] }, 400, "invalid_request");
    await refused({ name: "bad-env", steps: [{ type: "run", command: "true", envs: { [bad]: "x" } }] }, 400, "invalid_request");
  }
  assert.ok(!(await templateNames()).includes("local/bad-env"), "nothing was created");
});

test("a build that would stack more layers than a machine root can mount is refused before the stream", async () => {
  const steps = Array.from({ length: 45 }, (_v, i) => ({ type: "run", command: `echo ${i}` }));
  await refused({ name: "too-deep", steps }, 400, "invalid_request", /at most 40/);
  const envOnly = Array.from({ length: 45 }, (_v, i) => ({ type: "env", envs: { [`V${i}`]: "x" } }));
  await buildOk(k, { name: "many-env-steps", steps: envOnly });
});

test("Dockerfile input with the native backend is rejected", async () => {
  await refused({ name: "df", dockerfile: "FROM scratch\n", build_backend: "native" }, 400, "invalid_request", /native/);
  // Dockerfile and base_image builds themselves (the buildkit backend, the OCI importer): test/oci/pipeline.test.ts.
  await refused({ name: "df", dockerfile: "FROM scratch\n", registry_credentials: [{ registry: "ghcr.io", username: "u", password: "p" }] }, 400, "invalid_request", /ghcr\.io/);
  await refused({ name: "df", steps: [{ type: "run", command: "true" }], secrets: [{ id: "s", value: "v" }] }, 400, "invalid_request", /buildkit/);
  assert.ok(!(await templateNames()).includes("local/df"));
});

test("a context blob that is missing or does not match its sha256 fails before the stream", async () => {
  const missing = sha256hex("never uploaded");
  const env = await refused({ name: "ctx", context: { files: [{ path: "a.txt", sha256: missing }] }, steps: [{ type: "copy", src: "a.txt", dest: "/a.txt" }] }, 400, "invalid_request", /missing/);
  assert.equal(env.error_detail.cache_subject, "a.txt");
  const sha = await putBlob(k, "original bytes");
  writeFileSync(join(k.dataDir, "blobs", sha), "tampered bytes");
  await refused({ name: "ctx", context: { files: [{ path: "a.txt", sha256: sha }] } }, 400, "invalid_request", /does not match/);
  await refused({ name: "ctx", steps: [{ type: "copy", src: "nowhere.txt", dest: "/x" }] }, 400, "invalid_request", /not in context/);
  assert.ok(!(await templateNames()).includes("local/ctx"));
});

test("blob upload verifies the digest while streaming; a mismatch stores nothing; HEAD tells presence", async () => {
  const sha = sha256hex("the right bytes");
  const bad = await k.call("PUT", `/v1/templates/blobs/${sha}`, { raw: "the wrong bytes", headers: { "content-type": "application/octet-stream" } });
  assert.equal(bad.status, 400, bad.text);
  assert.equal((await k.call("HEAD", `/v1/templates/blobs/${sha}`)).status, 404);
  const good = await k.call("PUT", `/v1/templates/blobs/${sha}`, { raw: "the right bytes", headers: { "content-type": "application/octet-stream" } });
  assert.equal(good.status, 201, good.text);
  assert.equal(good.body.size, 15);
  assert.equal((await k.call("HEAD", `/v1/templates/blobs/${sha}`)).status, 200);
  assert.equal((await k.call("PUT", `/v1/templates/blobs/${sha}`, { raw: "the right bytes", headers: { "content-type": "application/octet-stream" } })).status, 200);
  assert.equal((await k.call("HEAD", "/v1/templates/blobs/not-a-digest")).status, 400);
});

test("name precedence: name, then template_name, then alias, then a generated name", async () => {
  const a = await buildOk(k, { template_name: "from-sdk", alias: "sdk-alias" });
  assert.equal(a.end.template_id, (await k.call("GET", "/v1/templates/from-sdk")).body.template_id);
  assert.deepEqual((await k.call("GET", "/v1/templates/from-sdk")).body.aliases, ["local/sdk-alias"]);
  const b = await buildOk(k, { alias: "alias-only" });
  const t = await k.call("GET", "/v1/templates/alias-only");
  assert.equal(t.body.canonical_ref, "local/alias-only");
  assert.deepEqual(t.body.aliases, [], "with only alias given, it is the template's name");
  assert.equal(b.end.template_id, t.body.template_id);
  const c = await buildOk(k, {});
  const gen = await k.call("GET", `/v1/templates/${c.end.template_id}`);
  assert.match(gen.body.canonical_ref, /^local\/tpl-/);
  const both = await buildOk(k, { name: "by-name", template_name: "ignored" });
  assert.equal((await k.call("GET", `/v1/templates/${both.end.template_id}`)).body.canonical_ref, "local/by-name");
});

test("an alias owned by another template is a 409 before the stream", async () => {
  await buildOk(k, { name: "owner-one", alias: "shared-alias" });
  await refused({ name: "owner-two", alias: "shared-alias" }, 409, "conflict", /alias/);
  await refused({ name: "owner-three", alias: "owner-one" }, 409, "conflict");
  assert.ok(!(await templateNames()).includes("local/owner-two"), "the refused build created nothing");
  await buildOk(k, { name: "owner-one", alias: "shared-alias" });
});

test("name_claim_token reserves a name for its holder", async () => {
  await buildOk(k, { name: "claimed", name_claim_token: "token-one-secret" });
  await refused({ name: "claimed", name_claim_token: "token-two-secret" }, 409, "conflict", /reserved/);
  await refused({ name: "claimed" }, 409, "conflict");
  await buildOk(k, { name: "claimed", name_claim_token: "token-one-secret" });
  assert.ok(!k.logs.some((l) => l.includes("token-one-secret")), "the token is never logged");
});

test("aliases: the ref may contain '/', exactly one trailing aliases segment is the subresource", async () => {
  await buildOk(k, { name: "aliases", alias: "nick" });
  const r = await k.call("GET", "/v1/templates/refs/local/aliases/aliases");
  assert.equal(r.status, 200, r.text);
  assert.deepEqual(r.body.map((a: { alias_ref: string }) => a.alias_ref), ["local/nick"]);
  assert.ok(Date.parse(r.body[0].created_at) > 0);
  const wrong = await k.call("GET", "/v1/templates/refs/local/aliases");
  assert.equal(wrong.status, 404, "local/aliases without the subresource segment names the ref `local`");
  assert.equal(wrong.body.code, "not_found");
  const unknown = await k.call("GET", "/v1/templates/refs/local/nope/aliases");
  assert.equal(unknown.status, 404);
  assert.equal(unknown.body.code, "not_found");
  const none = await k.call("GET", "/v1/templates/refs/local/owner-one/aliases");
  assert.deepEqual(none.body.map((a: { alias_ref: string }) => a.alias_ref), ["local/shared-alias"]);
});

test("build history: limit outside 1–100 and an unknown template are error envelopes", async () => {
  for (const limit of [0, 101]) {
    const r = await k.call("GET", `/v1/templates/default-tags/builds?limit=${limit}`);
    assert.equal(r.status, 400, r.text);
    assert.equal(r.body.code, "invalid_request");
  }
  assert.equal((await k.call("GET", "/v1/templates/default-tags/builds?cursor=garbage")).status, 400);
  assert.equal((await k.call("GET", "/v1/templates/no-such-template/builds")).status, 404);
  assert.equal((await k.call("GET", "/v1/templates/default-tags/builds?status=finished")).status, 400);
});

test("templates: get, delete refuses while a machine uses it, and a deleted template is gone", async () => {
  await buildOk(k, { name: "deletable", steps: [{ type: "write_file", path: "/marker", content: "x" }] });
  const m = await k.call("POST", "/v1/machines", { body: { template: "deletable" } });
  assert.equal(m.status, 201, m.text);
  const busy = await k.call("DELETE", "/v1/templates/deletable");
  assert.equal(busy.status, 409);
  await k.call("DELETE", `/v1/machines/${m.body.id}`);
  const del = await k.call("DELETE", "/v1/templates/deletable");
  assert.equal(del.status, 200, del.text);
  assert.equal((await k.call("GET", "/v1/templates/deletable")).status, 404);
  assert.equal((await k.call("POST", "/v1/machines", { body: { template: "deletable" } })).status, 404);
  assert.equal((await k.call("DELETE", "/v1/templates/base")).status, 409, "local/base is not deletable");
});
