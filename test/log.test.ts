// Secrets never reach a log line: every named field is redacted wherever it sits, and edge_token in URLs.

import { test } from "node:test";
import assert from "node:assert/strict";
import { Writable } from "node:stream";
import { mkdtemp, rm } from "node:fs/promises";
import { closeSync, constants, openSync, readFileSync } from "node:fs";
import { execFileSync, spawn } from "node:child_process";
import { once } from "node:events";
import type { EventEmitter } from "node:events";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { bufferedDestination, createLogger, scrubUrl, SECRET_FIELDS } from "../src/log.ts";

function capture() {
  const lines: string[] = [];
  const destination = new Writable({
    write(chunk, _enc, cb) {
      lines.push(String(chunk));
      cb();
    },
  });
  return { log: createLogger({ level: "info", destination }), lines };
}

const SECRET = "s3cr3t-value-that-must-not-appear";

for (const field of ["authorization", "password", "private_key", "passphrase", "signing_secret", "token", "secrets", "envs", "edge_token", "base_image_auth", "registry_credentials"]) {
  test(`${field} is redacted at the top level and nested`, () => {
    assert.ok((SECRET_FIELDS as readonly string[]).includes(field));
    const { log, lines } = capture();
    log.info({ [field]: SECRET }, "top");
    log.info({ outer: { [field]: SECRET } }, "nested");
    log.info({ a: { b: { [field]: { x: SECRET } } } }, "deep");
    const out = lines.join("");
    assert.equal(lines.length, 3);
    assert.ok(!out.includes(SECRET), out);
    assert.ok(out.includes("[Redacted]"));
  });
}

test("request headers: authorization is redacted", () => {
  const { log, lines } = capture();
  log.info({ req: { headers: { authorization: `Bearer ${SECRET}` } } }, "req");
  assert.ok(!lines.join("").includes(SECRET));
});

test("edge_token query parameters are scrubbed from URLs", () => {
  assert.equal(scrubUrl(`/edge/svc_1/path?edge_token=${SECRET}&x=1`), "/edge/svc_1/path?edge_token=[Redacted]&x=1");
  assert.equal(scrubUrl(`/a?x=1&edge_token=${SECRET}`), "/a?x=1&edge_token=[Redacted]");
  const { log, lines } = capture();
  log.info({ req: { method: "GET", url: `/edge/x?edge_token=${SECRET}` } }, "request");
  assert.ok(!lines.join("").includes(SECRET));
});

test("log lines dropped while the output is stuck are counted in a warning once it drains; none vanish unsaid", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-log-stuck-"));
  const fifo = join(dir, "fifo");
  const out = join(dir, "out");
  execFileSync("mkfifo", [fifo]);
  // A reader that never reads: the pipe fills (64 KiB) and the writer's writes wait, as behind a stuck log collector.
  const idle = openSync(fifo, constants.O_RDONLY | constants.O_NONBLOCK);
  try {
    const dest = bufferedDestination(fifo) as unknown as EventEmitter & { write(line: string): boolean; flush(cb: () => void): void; end(): void };
    await once(dest, "ready");
    const line = (i: number) => `${JSON.stringify({ level: 30, i, pad: "x".repeat(1000) })}\n`;
    const total = 20_000; // ≈ 20 MiB: past the 16 MiB held while stuck
    for (let i = 0; i < total; i++) dest.write(line(i));
    // The collector comes back: everything pending drains, then one more line is written.
    const cat = spawn("sh", ["-c", `exec cat "$1" > "$2"`, "sh", fifo, out]);
    await new Promise<void>((resolve) => dest.flush(() => resolve()));
    dest.write(line(total));
    const closed = once(dest, "close");
    dest.end();
    await closed;
    await once(cat, "exit");
    const lines = readFileSync(out, "utf8").trim().split("\n").map((l) => JSON.parse(l) as { i?: number; level: number; dropped_lines?: number; msg?: string });
    const kept = lines.filter((l) => l.i !== undefined);
    const notes = lines.filter((l) => l.dropped_lines !== undefined);
    assert.equal(notes.length, 1, "one warning says lines were dropped");
    assert.equal(notes[0]!.level, 40);
    assert.ok(notes[0]!.dropped_lines! > 0, "some were dropped (the output was stuck past the bound)");
    assert.equal(kept.length + notes[0]!.dropped_lines!, total + 1, "every line written is either in the log or counted as dropped");
    assert.equal(kept.at(-1)!.i, total, "the line after the drain is kept, after the warning");
    assert.equal(lines.at(-2)!.dropped_lines, notes[0]!.dropped_lines, "the warning comes just before it");
  } finally {
    closeSync(idle);
    await rm(dir, { recursive: true, force: true });
  }
});
