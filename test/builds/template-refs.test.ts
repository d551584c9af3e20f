// Template references without a tag (issue 24, item 3): `name` means `name:default`, else `name:latest`, else the
// template's only tag; a miss on a template that exists names the tags it has instead of "no template".

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { buildOk, sh } from "./support.ts";
import { chooseTag } from "../../src/templates/resolver.ts";
import { cliPipes } from "../support/cli.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

const file = (content: string) => [{ type: "write_file", path: "/version", content }];

async function createFrom(template: string) {
  return k.call("POST", "/v1/machines", { body: { template, timeout_s: 120 } });
}

test("a ref without a tag takes default, then latest, then the only tag; otherwise none", () => {
  assert.equal(chooseTag(undefined, ["default", "latest", "v1"]), "default");
  assert.equal(chooseTag(undefined, ["latest", "v1"]), "latest");
  assert.equal(chooseTag(undefined, ["v1"]), "v1");
  assert.equal(chooseTag(undefined, ["v1", "v2"]), null);
  assert.equal(chooseTag("v2", ["v1", "v2"]), "v2");
  assert.equal(chooseTag("v3", ["v1", "v2"]), null);
  assert.equal(chooseTag(undefined, []), null);
});

test("a template name without a tag resolves to its only tag, and a miss names the tags that exist", async () => {
  await buildOk(k, { name: "cli-tools", tags: ["v1"], steps: file("1") });
  const one = await createFrom("cli-tools");
  assert.equal(one.status, 201, one.text);
  assert.equal((await sh(k, one.body.id, "cat /version")).stdout, "1");

  // Through the CLI as the issue tried it.
  const cli = cliPipes(k.url, ["machines", "create", "-t", "cli-tools"]);
  assert.equal(await cli.exited, 0, cli.stderr());
  assert.match(cli.stdout(), /^mch_/);

  await buildOk(k, { name: "cli-tools", tags: ["v2"], steps: file("2") });
  const ambiguous = await createFrom("cli-tools");
  assert.equal(ambiguous.status, 404, ambiguous.text);
  assert.match(ambiguous.body.error, /local\/cli-tools has several tags.*\(v1, v2\), as cli-tools:v1/);
  assert.deepEqual(ambiguous.body.error_detail.details.tags, ["v1", "v2"]);
  const wrongTag = await createFrom("local/cli-tools:v3");
  assert.equal(wrongTag.status, 404);
  assert.match(wrongTag.body.error, /has no tag "v3"; its tags: v1, v2/);
  assert.equal((await createFrom("cli-tools:v2")).status, 201);

  // A `latest` tag settles it, and a `default` tag wins over `latest`.
  await buildOk(k, { name: "cli-tools", tags: ["latest"], steps: file("3") });
  const latest = await createFrom("cli-tools");
  assert.equal(latest.status, 201, latest.text);
  assert.equal((await sh(k, latest.body.id, "cat /version")).stdout, "3");
  await buildOk(k, { name: "cli-tools", steps: file("4") });
  const dflt = await createFrom("cli-tools");
  assert.equal((await sh(k, dflt.body.id, "cat /version")).stdout, "4");

  // A template that does not exist at all is still "no template".
  const none = await createFrom("no-such-tools");
  assert.equal(none.status, 404);
  assert.match(none.body.error, /No template "no-such-tools"/);
});
