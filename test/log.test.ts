// Secrets never reach a log line: every named field is redacted wherever it sits, and edge_token in URLs.

import { test } from "node:test";
import assert from "node:assert/strict";
import { Writable } from "node:stream";
import { createLogger, scrubUrl, SECRET_FIELDS } from "../src/log.ts";

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
