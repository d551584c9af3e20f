// The rest of E2B's template API through the published `e2b` SDK against a real Kiln, mapped onto Kiln's own
// templates and tags: `Template.assignTags` points tags at a built artifact (a sandbox is then created by the new
// tag), `Template.removeTags` drops them (creates by the tag fail with E2B's 404), `GET /templates` and
// `GET /templates/{id}` list Kiln's templates as E2B's, `DELETE /templates/{id}` removes one as `DELETE
// /v1/templates/{ref}` does (same refusals). Bad input answers E2B's error shape and changes nothing; a revoked key
// and a name reserved by a native `name_claim_token` change nothing either.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { ApiClient, ConnectionConfig, Sandbox, Template, TemplateError } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { hostArchSupported } from "../support/mini-rootfs.ts";

const skip = hostArchSupported() ? undefined : "x86-64 only";
const NAME = "e2b-tags";
let k: TestKiln;
let key: string;
let opts: { apiKey: string; apiUrl: string; sandboxUrl: string; requestTimeoutMs: number };
let other: typeof opts;
const sandboxes: Sandbox[] = [];
/** The build ids of the two builds: `default` → "one", `v2` → "two". */
const built: Record<string, string> = {};

before(async () => {
  if (skip) return;
  key = generateKeyIn("e2b");
  k = await startTestKiln({ env: { KILN_API_KEY: key } });
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 120_000 };
  other = { ...opts, apiKey: (await k.kiln.services.keys.create("e2b-other", generateKeyIn("e2b"))).key };
  const one = await Template.build(Template().fromBaseImage().runCmd("echo one > /version"), NAME, opts);
  const two = await Template.build(Template().fromBaseImage().runCmd("echo two > /version"), `${NAME}:v2`, opts);
  built.default = one.buildId;
  built.v2 = two.buildId;
});

after(async () => {
  for (const s of sandboxes) await s.kill().catch(() => undefined);
  await k?.close();
});

/** The SDK's own API client: the calls it has no method for (listing, deleting templates) go through it. */
const api = (o = opts) => new ApiClient(new ConnectionConfig(o)).api;

async function versionOf(template: string): Promise<string> {
  const sbx = await Sandbox.create(template, { ...opts, timeoutMs: 120_000 });
  sandboxes.push(sbx);
  const r = await sbx.commands.run("cat /version");
  await sbx.kill();
  return r.stdout.trim();
}

/** The template's tags and the builds they point at, as Template.getTags shows them. */
async function tagsOf(name = NAME): Promise<Record<string, string>> {
  return Object.fromEntries((await Template.getTags(name, opts)).map((t) => [t.tag, t.buildId]));
}

/** What a create by `template` fails with. */
async function createFails(template: string): Promise<Error & { statusCode?: number }> {
  const err = await Sandbox.create(template, { ...opts, timeoutMs: 60_000 }).then(
    (s) => {
      sandboxes.push(s);
      return undefined;
    },
    (e: unknown) => e as Error & { statusCode?: number },
  );
  assert.ok(err, `creating from ${template} should fail`);
  return err;
}

/** An SDK call's rejection: E2B's error shape came back as the SDK's TemplateError with the status in its message. */
async function refused(call: Promise<unknown>, status: number, message: RegExp) {
  await assert.rejects(call, (err: unknown) => {
    assert.ok(err instanceof TemplateError, String(err));
    assert.match((err as Error).message, new RegExp(`^${status}: ${message.source}`));
    return true;
  });
}

test("Template.assignTags points a tag at the build another tag names: Sandbox.create by the new tag runs that build", { skip }, async () => {
  assert.deepEqual(await tagsOf(), { default: built.default, v2: built.v2 });
  const r = await Template.assignTags(`${NAME}:v2`, ["production", "stable"], opts);
  assert.deepEqual(r, { buildId: built.v2, tags: ["production", "stable"] });
  assert.deepEqual(await tagsOf(), { default: built.default, v2: built.v2, production: built.v2, stable: built.v2 });
  assert.equal(await versionOf(`${NAME}:production`), "two");
  assert.equal(await Template.exists(`${NAME}:production`, opts), true);
  // Without a tag the target is what the name means to a create (its default tag); an existing tag moves.
  assert.deepEqual(await Template.assignTags(NAME, "stable", opts), { buildId: built.default, tags: ["stable"] });
  assert.equal(await versionOf(`${NAME}:stable`), "one");
  // The native API sees the same tags: one implementation.
  const native = await k.call("GET", `/v1/templates/${NAME}`, { key });
  assert.equal(native.status, 200, native.text);
  assert.deepEqual(Object.keys(native.body.tags).sort(), ["default", "production", "stable", "v2"]);
});

test("Template.removeTags removes the tags: the tag is gone, a create by it fails with E2B's 404, the rest stay", { skip }, async () => {
  await Template.assignTags(`${NAME}:v2`, "canary", opts);
  await Template.removeTags(NAME, ["canary", "never-was"], opts);
  const tags = await tagsOf();
  assert.equal(tags.canary, undefined);
  assert.equal(tags.v2, built.v2);
  assert.equal(await Template.exists(`${NAME}:canary`, opts), false);
  const err = await createFails(`${NAME}:canary`);
  assert.equal(err.statusCode, 404, String(err));
  assert.match(err.message, /^404: Template local\/e2b-tags has no tag "canary"/);
  // The artifact v2 points at is still tagged: nothing starts its retention clock.
  const art = await k.kiln.services.store.db.selectFrom("artifacts").select("retention_expires_at").where("build_id", "=", built.v2).executeTakeFirstOrThrow();
  assert.equal(art.retention_expires_at, null);
});

test("GET /templates lists Kiln's templates as E2B's; GET /templates/{id} shows one with its builds", { skip }, async () => {
  const list = await api().GET("/templates");
  assert.equal(list.response.status, 200);
  const mine = list.data!.find((t) => t.names.includes(NAME));
  assert.ok(mine, JSON.stringify(list.data));
  const native = await k.call("GET", `/v1/templates/${NAME}`, { key });
  assert.equal(mine.templateID, native.body.template_id);
  assert.equal(mine.buildID, built.default, "the build its name means to a create");
  assert.equal(mine.buildStatus, "ready");
  assert.equal(mine.buildCount, 2);
  assert.ok(mine.spawnCount >= 2, `sandboxes made from it: ${mine.spawnCount}`);
  assert.equal(mine.public, false);
  assert.ok(list.data!.some((t) => t.names.includes("base")), "Kiln's base template is listed too");

  const one = await api().GET("/templates/{templateID}", { params: { path: { templateID: NAME } } });
  assert.equal(one.response.status, 200);
  assert.equal(one.data!.templateID, mine.templateID);
  assert.deepEqual(one.data!.builds.map((b) => b.buildID).sort(), [built.default, built.v2].sort());
  assert.ok(one.data!.builds.every((b) => b.status === "ready"));
  const page = await api().GET("/templates/{templateID}", { params: { path: { templateID: mine.templateID }, query: { limit: 1 } } });
  assert.equal(page.data!.builds.length, 1);
  const next = page.response.headers.get("x-next-token");
  assert.ok(next);
  const rest = await api().GET("/templates/{templateID}", { params: { path: { templateID: mine.templateID }, query: { limit: 1, nextToken: next } } });
  assert.equal(rest.data!.builds.length, 1);
  assert.notEqual(rest.data!.builds[0]!.buildID, page.data!.builds[0]!.buildID);
  assert.equal((await api().GET("/templates/{templateID}", { params: { path: { templateID: mine.templateID }, query: { nextToken: "not-ours" } } })).response.status, 400);
  assert.equal((await api().GET("/templates/{templateID}", { params: { path: { templateID: "no-such-template" } } })).response.status, 404);
  // E2B's time-cursor build log is not served (the status route's logsOffset paging carries the same log): 501, saying so.
  const logs = await k.call("GET", `/templates/${mine.templateID}/builds/${built.default}/logs`, { key });
  assert.equal(logs.status, 501);
  assert.match(logs.body.message, /status\?logsOffset=/);
});

test("bad input answers E2B's error shape and changes nothing: bad tags, unknown templates and tags, a name with a tag, the default tag", { skip }, async () => {
  const before = await tagsOf();
  await refused(Template.assignTags(`${NAME}:v2`, "bad tag!", opts), 400, /Invalid tag "bad tag!"/);
  await refused(Template.assignTags(`${NAME}:v2`, ["ok-tag", "-leading-dash"], opts), 400, /Invalid tag "-leading-dash"/);
  await refused(Template.assignTags(`${NAME}:v2`, [], opts), 400, /At least one tag is required/);
  await refused(Template.assignTags(`${NAME}:v2`, "x".repeat(129), opts), 400, /Invalid tag/);
  await refused(Template.assignTags(`${NAME}:no-such-tag`, "prod", opts), 404, /Template local\/e2b-tags has no tag "no-such-tag"/);
  await refused(Template.assignTags("no-such-template:v1", "prod", opts), 404, /No template "no-such-template"/);
  await refused(Template.assignTags(`${NAME}:`, "prod", opts), 400, /Invalid target/);
  await refused(Template.removeTags(`${NAME}:v2`, "v2", opts), 400, /Template name should not contain a tag/);
  await refused(Template.removeTags(NAME, "default", opts), 400, /Cannot delete the 'default' tag/);
  await refused(Template.removeTags(NAME, "bad tag!", opts), 400, /Invalid tag/);
  await refused(Template.removeTags("no-such-template", "v2", opts), 404, /No template "no-such-template"/);
  const extra = await k.call("POST", "/templates/tags", { key, body: { target: `${NAME}:v2`, tags: ["x"], names: ["x"] } });
  assert.equal(extra.status, 400);
  assert.equal(extra.body.code, 400, extra.text);
  const notJson = await k.call("DELETE", "/templates/tags", { key, raw: "{", headers: { "content-type": "application/json" } });
  assert.equal(notJson.status, 400);
  assert.deepEqual(await tagsOf(), before, "nothing changed");
});

test("a revoked key changes nothing; a name reserved by a native name_claim_token moves its tags only through its builds", { skip }, async () => {
  // Kiln's templates belong to the server: another active key sees the same templates and tags (as on /v1).
  assert.deepEqual(Object.fromEntries((await Template.getTags(NAME, other)).map((t) => [t.tag, t.buildId])), await tagsOf());
  const before = await tagsOf();
  const revoked = await k.kiln.services.keys.create("e2b-revoked", generateKeyIn("e2b"));
  await k.kiln.services.keys.revoke(revoked.id);
  const gone = { ...opts, apiKey: revoked.key };
  await assert.rejects(Template.assignTags(`${NAME}:v2`, "stolen", gone), /Unauthorized/);
  await assert.rejects(Template.removeTags(NAME, "v2", gone), /Unauthorized/);
  assert.equal((await api(gone).DELETE("/templates/{templateID}", { params: { path: { templateID: NAME } } })).response.status, 401);
  assert.equal((await api(gone).GET("/templates")).response.status, 401);
  assert.deepEqual(await tagsOf(), before);

  const claim = `claim-${randomBytes(8).toString("hex")}`;
  const b = await k.call("POST", "/v1/templates/build", { key, body: { name: "e2b-claimed", name_claim_token: claim, tags: ["v1"], steps: [{ type: "run", command: "echo claimed > /version" }] } });
  assert.equal(b.status, 200, b.text);
  assert.match(b.text, /event: end/);
  await refused(Template.assignTags("e2b-claimed:v1", "prod", other), 409, /The name local\/e2b-claimed is reserved by a name_claim_token/);
  await refused(Template.removeTags("e2b-claimed", "v1", opts), 409, /The name local\/e2b-claimed is reserved by a name_claim_token/);
  assert.deepEqual(Object.keys((await k.call("GET", "/v1/templates/e2b-claimed", { key })).body.tags), ["v1"]);
});

test("DELETE /templates/{id} removes a template as DELETE /v1/templates does: refused while a sandbox uses it, then exists() is false", { skip }, async () => {
  const sbx = await Sandbox.create(`${NAME}:v2`, { ...opts, timeoutMs: 120_000 });
  sandboxes.push(sbx);
  const del = () => api().DELETE("/templates/{templateID}", { params: { path: { templateID: NAME } } });
  const busy = await del();
  assert.equal(busy.response.status, 409);
  assert.match((busy.error as { message: string }).message, /is used by 1 machine/);
  assert.equal(await Template.exists(NAME, opts), true);
  await sbx.kill();
  assert.equal((await del()).response.status, 204);
  assert.equal(await Template.exists(NAME, opts), false);
  assert.equal(await Template.exists(`${NAME}:v2`, opts), false);
  assert.ok(!(await api().GET("/templates")).data!.some((t) => t.names.includes(NAME)));
  assert.equal((await k.call("GET", `/v1/templates/${NAME}`, { key })).status, 404);
  const again = await del();
  assert.equal(again.response.status, 404);
  assert.equal((again.error as { code: number }).code, 404);
  // Kiln's own base template is never deleted, whoever asks.
  const base = await api().DELETE("/templates/{templateID}", { params: { path: { templateID: "base" } } });
  assert.equal(base.response.status, 409);
  assert.equal(await Template.exists("base", opts), true);
});
