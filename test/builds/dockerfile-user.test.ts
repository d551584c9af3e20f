// Dockerfile templates' default user (issue 24, item 4): with no USER at all, a Dockerfile on a Kiln template keeps
// that template's user (local/base: `user`) while its RUN steps run as root; the build log says which user machines
// will run as, and why.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { buildOk, machineFrom, sh } from "./support.ts";
import { dockerfileImages, finalStageBase } from "../../src/builder/backends/dockerfile-images.ts";

const skip = spawnSync("buildah", ["--version"]).status !== 0 ? "buildah is not installed (scripts/up.sh installs it)" : undefined;

let k: TestKiln;
before(async () => {
  if (!skip) k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

test("the built stage's base image is found through stage aliases and --target", () => {
  const base = (text: string, target?: string) => finalStageBase(dockerfileImages(text), target);
  assert.equal(base("FROM local/base\nRUN true\n"), "local/base");
  assert.equal(base("FROM debian:12 AS build\nFROM local/base AS run\nCOPY --from=build /x /x\n"), "local/base");
  assert.equal(base("FROM local/tools AS a\nFROM a AS b\nFROM b\n"), "local/tools");
  assert.equal(base("FROM local/tools AS a\nFROM debian AS b\nFROM a\n", "b"), "debian");
  assert.equal(base("FROM scratch\nCOPY x /x\n"), null);
  assert.equal(base("ARG IMG=x\nFROM $IMG\n"), null);
});

// A Dockerfile on local/base runs on Kiln's executor (test/builds/dockerfile-cache.test.ts); the builder's path keeps
// the same rule (src/builder/sources/dockerfile.ts, machineUser).
// A Dockerfile or image that sets USER runs machines as that user through the same importer as base_image imports
// (test/oci/machines.test.ts, "a machine runs commands as the image's User").
test("a Dockerfile on local/base without USER keeps the template's user; its RUN steps ran as root; the log says so", { skip, timeout: 300_000 }, async () => {
  const r = await buildOk(k, { name: "df-nouser", dockerfile: "FROM local/base\nRUN whoami > /built-as\n" });
  const said = r.events.find((e) => /machines from this template run as/.test(e.data.message));
  assert.ok(said, "the build log names the machines' user");
  assert.match(said!.data.message, /run as "user" \(the Dockerfile sets no USER, so machines keep the user of template local\/base\)/);
  const m = await machineFrom(k, "df-nouser");
  assert.equal((await sh(k, m, "whoami; cat /built-as")).stdout, "user\nroot\n");
  // A machine can still ask for another user.
  const asked = await k.call("POST", "/v1/machines", { body: { template: "df-nouser", user: "root" } });
  assert.equal(asked.status, 201, asked.text);
  assert.equal((await sh(k, asked.body.id, "whoami")).stdout, "root\n");
});
