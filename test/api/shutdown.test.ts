// Stopping a server is bounded: requests still open after KILN_SHUTDOWN_GRACE_MS (a body that never ends, a stream
// that ends only with its client) lose their connections instead of holding the stop until their client gives up.

import { test } from "node:test";
import assert from "node:assert/strict";
import { connect } from "node:net";
import { once } from "node:events";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";

test("a stop with a request still open closes its connection after the shutdown grace, and only then", async () => {
  const k = await startTestKiln({ waitForBase: false, env: { KILN_SHUTDOWN_GRACE_MS: "1500" } });
  try {
    const { hostname, port } = new URL(k.url);
    const socket = connect(Number(port), hostname);
    await once(socket, "connect");
    // A body promised but never sent: the route waits for it.
    socket.write(`POST /v1/machines HTTP/1.1\r\nhost: ${hostname}\r\nauthorization: Bearer ${TEST_KEY}\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{"tem`);
    let answered = "";
    socket.on("data", (d) => (answered += d));
    const closed = once(socket, "close");
    await new Promise((r) => setTimeout(r, 100)); // the request reaches its route
    const t0 = performance.now();
    await k.stop();
    const took = performance.now() - t0;
    await closed;
    assert.ok(took >= 1400, `stop waited ${Math.round(took)} ms: less than the grace`);
    assert.ok(took < 1500 + 5000, `stop took ${Math.round(took)} ms: the grace did not bound it`);
    assert.equal(answered, "", "the half-sent request got no answer, only a closed connection");
  } finally {
    await k.close();
  }
});
