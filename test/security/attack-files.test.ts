// Machine root against the guest agent's file routes: a FIFO or a device a machine made (or a symlink to one) is
// refused by GET …/files at once, never opened through — an open that blocks held one of the agent's few I/O
// threads, and four of them left every file call of the machine hanging.

import { test } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";

test("GET files refuses FIFOs and devices at once, and the machine's file routes keep answering", { timeout: 240_000 }, async () => {
  const k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  try {
    const m = await k.call("POST", "/v1/machines", { body: { timeout_s: 600 } });
    assert.equal(m.status, 201, m.text);
    const id = m.body.id as string;
    const made = await k.call("POST", `/v1/machines/${id}/exec`, {
      body: { cmd: "mkfifo /workspace/fifo && ln -s /workspace/fifo /workspace/to-fifo && ln -s /dev/zero /workspace/zero && echo real > /workspace/real && ln -s /workspace/real /workspace/to-real", user: "root" },
    });
    assert.equal(made.body.exit_code, 0, made.text);

    const started = Date.now();
    const reads = await Promise.all(
      ["fifo", "to-fifo", "fifo", "to-fifo", "fifo", "fifo", "zero", "zero"].map((name) => k.call("GET", `/v1/machines/${id}/files?path=/workspace/${name}`)),
    );
    for (const r of reads) {
      assert.equal(r.status, 400, r.text);
      assert.equal(r.body.code, "invalid_request");
      assert.match(r.body.error, /is not a regular file/);
    }
    assert.ok(Date.now() - started < 20_000, `refused at once, not at a timeout (${Date.now() - started} ms)`);

    // Every file route still answers: none of the agent's I/O threads is held.
    const info = await k.call("POST", `/v1/machines/${id}/files/info`, { body: { path: "/workspace/real" } });
    assert.equal(info.status, 200, info.text);
    const real = await k.call("GET", `/v1/machines/${id}/files?path=/workspace/to-real`);
    assert.equal(real.status, 200);
    assert.equal(real.text, "real\n", "a symlink to a regular file is still read through");
    const put = await k.call("PUT", `/v1/machines/${id}/files?path=/workspace/fifo`, { raw: "replaced", headers: { "content-type": "application/octet-stream" } });
    assert.equal(put.status, 200, put.text);
    assert.equal((await k.call("GET", `/v1/machines/${id}/files?path=/workspace/fifo`)).text, "replaced", "an upload replaces a FIFO with a file");
  } finally {
    await k.close();
  }
});
