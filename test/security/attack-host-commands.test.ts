// The server's one host command helper (src/runtime/host-commands.ts) runs every host command of every machine: a
// command that ends without reading its input (a machine whose first process is already gone, so `nsenter` into it
// fails at once) must fail alone, not take the helper — and every other command in flight — down with it.

import { test } from "node:test";
import assert from "node:assert/strict";
import { execHost } from "../../src/runtime/host-commands.ts";

test("a command that exits without reading its input fails alone; commands in flight beside it answer", async () => {
  // Started first and still running when the other one ends: it is answered only if the helper lives on.
  const beside = execHost("sh", ["-c", "read line; echo got $line"], { input: "x\n", timeout: 20_000 });
  const slow = execHost("sh", ["-c", "sleep 0.5; echo slept"], { timeout: 20_000 });
  // More input than a pipe holds: the helper is still writing it when sh has exited (EPIPE).
  const quitter = execHost("sh", ["-c", "exit 3"], { input: "y".repeat(4 * 1024 * 1024), timeout: 20_000 });
  await assert.rejects(quitter, (err: Error & { code?: unknown }) => {
    assert.doesNotMatch(err.message, /helper exited/, "the command's own failure, not the helper's");
    return true;
  });
  assert.equal((await beside).stdout, "got x\n");
  assert.equal((await slow).stdout, "slept\n");
  // And the helper still takes new commands.
  assert.equal((await execHost("echo", ["after"])).stdout, "after\n");
});
