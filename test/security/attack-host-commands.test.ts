// The server's one host command helper (src/runtime/host-commands.ts) runs every host command of every machine: a
// command that ends without reading its input (a machine whose first process is already gone, so `nsenter` into it
// fails at once) must fail alone, not take the helper — and every other command in flight — down with it.

import { test } from "node:test";
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
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

/** Pids whose command line holds `marker` (a command the helper started and should have ended). */
function running(marker: string): number[] {
  const found: number[] = [];
  for (const pid of readdirSync("/proc").filter((p) => /^\d+$/.test(p))) {
    let cmdline = "";
    try {
      cmdline = readFileSync(`/proc/${pid}/cmdline`, "utf8");
    } catch {
      continue; // gone meanwhile
    }
    if (cmdline.includes(marker)) found.push(Number(pid));
  }
  return found;
}

test("a command printing past the output cap is ended and refused with the cap's error; the helper takes the next one", async () => {
  const marker = `kiln-cap-${process.pid}-${Date.now()}`;
  // Endless output: only the cap ends it (the timeout is far beyond what the test waits).
  const endless = execHost("sh", ["-c", `exec yes ${marker}`], { maxBuffer: 64 * 1024, timeout: 120_000 });
  await assert.rejects(endless, (err: Error & { code?: unknown; stdout?: string }) => {
    assert.equal(err.code, "ERR_CHILD_PROCESS_STDIO_MAXBUFFER");
    assert.match(err.message, /maxBuffer length exceeded/);
    assert.ok((err.stdout ?? "").length <= 64 * 1024, "no more than the cap is carried back");
    return true;
  });
  // The command itself was ended, not left writing into a pipe nobody reads.
  for (let i = 0; i < 200 && running(marker).length > 0; i++) await new Promise((r) => setTimeout(r, 25));
  assert.deepEqual(running(marker), [], "the capped command still runs");
  // The default cap (1 MiB) holds for a command that does not name one; just under it, the output comes back whole.
  await assert.rejects(execHost("head", ["-c", String(2 * 1024 * 1024), "/dev/zero"]), (err: Error & { code?: unknown }) => err.code === "ERR_CHILD_PROCESS_STDIO_MAXBUFFER");
  assert.equal((await execHost("head", ["-c", String(1024 * 1024 - 1), "/dev/zero"])).stdout.length, 1024 * 1024 - 1);
  assert.equal((await execHost("echo", ["after"])).stdout, "after\n");
});
