// Cache keys of the three tiers: a layer key chains its parent's, inputs change keys, order does not.

import { test } from "node:test";
import assert from "node:assert/strict";
import { canonicalJson, contextDigest, layerKey, sourceDigest } from "../../src/builder/cache/keys.ts";

test("a layer key depends on its parent, its text and its inputs, so changing step k changes every key after it", () => {
  const root = "sha256:base";
  const k1 = layerKey(root, "RUN a", []);
  const k2 = layerKey(k1, "RUN b", []);
  assert.equal(layerKey(root, "RUN a", []), k1, "same input, same key");
  const k1x = layerKey(root, "RUN A", []);
  assert.notEqual(k1x, k1);
  assert.notEqual(layerKey(k1x, "RUN b", []), k2, "a changed parent changes the child");
  assert.notEqual(layerKey(k1, "RUN b", ["f\0sha\0"]), k2, "input digests are part of the key");
  // Length-prefixed parts: moving a boundary between text and inputs cannot collide.
  assert.notEqual(layerKey(root, "ab", ["c"]), layerKey(root, "a", ["bc"]));
});

test("context and source digests ignore order and key order but nothing else", () => {
  const a = { path: "a", sha256: "1".repeat(64) };
  const b = { path: "b", sha256: "2".repeat(64), mode: "0755" };
  assert.equal(contextDigest([a, b]), contextDigest([b, a]));
  assert.notEqual(contextDigest([a, b]), contextDigest([a, { ...b, mode: "0644" }]));
  assert.equal(canonicalJson({ b: 1, a: [2, { d: 3, c: 4 }] }), `{"a":[2,{"c":4,"d":3}],"b":1}`);
  const base = { sourceDigest: "s", dockerfile: "FROM x\n", contextDigest: "c" };
  assert.equal(sourceDigest({ ...base, runtimeDefaults: { envs: { A: "1" }, cwd: "/" } }), sourceDigest({ ...base, runtimeDefaults: { cwd: "/", envs: { A: "1" } } }));
  assert.notEqual(sourceDigest(base), sourceDigest({ ...base, startCmd: "serve" }));
});
