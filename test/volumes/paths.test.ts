// The pure parts of volumes: volume path normalisation (rooted at /, `..` stops at the root), which events a watch
// covers, and the watch frame checks.

import { test } from "node:test";
import assert from "node:assert/strict";
import { volumePathComponents, volumePathOf } from "../../src/volumes/files.ts";
import { checkWatchFrame, watchCovers } from "../../src/volumes/watch-frames.ts";
import { KilnError } from "../../src/errors.ts";

test("volume paths are rooted at / and `..` never climbs above it", () => {
  assert.deepEqual(volumePathComponents("/"), []);
  assert.deepEqual(volumePathComponents("/a/./b//c/"), ["a", "b", "c"]);
  assert.deepEqual(volumePathComponents("/../../etc/passwd"), ["etc", "passwd"]);
  assert.deepEqual(volumePathComponents("/a/b/../../../x"), ["x"]);
  assert.equal(volumePathOf(volumePathComponents("/a/../b/")), "/b");
  for (const bad of ["a/b", "", "./x", "/a\0b"]) assert.throws(() => volumePathComponents(bad), (e: unknown) => e instanceof KilnError && e.code === "invalid_request", bad);
});

test("a watch covers its path and direct children; recursive covers everything below", () => {
  assert.equal(watchCovers("/a", false, "/a"), true);
  assert.equal(watchCovers("/a", false, "/a/b"), true);
  assert.equal(watchCovers("/a", false, "/a/b/c"), false);
  assert.equal(watchCovers("/a", true, "/a/b/c"), true);
  assert.equal(watchCovers("/a", true, "/ab"), false, "a sibling with a common prefix is not below");
  assert.equal(watchCovers("/", false, "/x"), true);
  assert.equal(watchCovers("/", false, "/x/y"), false);
  assert.equal(watchCovers("/", true, "/x/y"), true);
});

test("watch frames: relative paths and user-scoped watches are invalid; unknown fields and types too", () => {
  assert.deepEqual(checkWatchFrame(JSON.stringify({ type: "file_watch", request_id: "r", path: "/a", recursive: true })), { ok: true, frame: { type: "file_watch", request_id: "r", path: "/a", recursive: true } });
  assert.equal(checkWatchFrame(JSON.stringify({ type: "file_unwatch", watch_id: "w1" })).ok, true);
  for (const bad of [
    { type: "file_watch", request_id: "r", path: "a" },
    { type: "file_watch", request_id: "r", path: "/a", user: "user" },
    { type: "file_watch", request_id: "r" },
    { type: "file_watch", request_id: "r", path: "/a", recursive: 1 },
    { type: "file_watch", request_id: "r", path: "/a", extra: true },
    { type: "file_unwatch", request_id: "r" },
    { type: "nope", request_id: "r" },
  ]) {
    const c = checkWatchFrame(JSON.stringify(bad));
    assert.equal(c.ok, false, JSON.stringify(bad));
    if (!c.ok) assert.equal(c.request_id, "r");
  }
  assert.equal(checkWatchFrame("[1]").ok, false);
  assert.equal(checkWatchFrame("{").ok, false);
});
