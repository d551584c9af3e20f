// Who may open what machines' egress refuses by default (docs/security/api.md): the host's other addresses, private
// networks and cloud metadata are the operator's to open (as webhook allow_private is), on the native API and E2B's.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { checkOpenings } from "../../src/machines/create.ts";

let k: TestKiln;
let lesser: string;

before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" }, waitForBase: false });
  const made = await k.call("POST", "/v1/keys", { body: { name: "lesser" } });
  assert.equal(made.status, 201, made.text);
  lesser = made.body.key;
});
after(async () => k?.close());

test("only the operator's key opens private, link-local, metadata or host ranges with allow_out; public ranges are any key's", async () => {
  // A template that does not exist: a request past the check answers 404, so no machine boots here.
  const create = (key: string | undefined, allow_out: string[]) => k.call("POST", "/v1/machines", { key, body: { template: "nobody/none", network: { allow_out } } });
  for (const range of ["10.0.0.0/8", "10.1.2.3", "169.254.169.254", "0.0.0.0/0", "192.168.0.0/15", "fd00::/8", "::/0", "::ffff:10.0.0.1", "64:ff9b::a00:1"]) {
    const res = await create(lesser, ["203.0.113.0/24", range]);
    assert.equal(res.status, 403, `${range}: ${res.text}`);
    assert.equal(res.body.code, "forbidden");
    assert.match(res.body.error, /allow_out\[1\].*only the operator's key/);
    assert.equal((await create(undefined, [range])).status, 404, `the operator opens ${range}`);
  }
  for (const range of ["203.0.113.0/24", "8.8.8.8", "2001:db8::/32"]) assert.equal((await create(lesser, [range])).status, 404, range);
  // Closing is anyone's: deny_out alone is not checked.
  assert.equal((await k.call("POST", "/v1/machines", { key: lesser, body: { template: "nobody/none", network: { deny_out: ["10.0.0.0/8"] } } })).status, 404);
});

test("E2B: Sandbox create with network.allowOut into a private range takes the operator's key", async () => {
  const e2bKey = (await k.call("POST", "/v1/keys", { key: lesser, body: { name: "e2b-lesser", format: "e2b" } })).body.key as string;
  const res = await request(`${k.url}/sandboxes`, { method: "POST", headers: { "x-api-key": e2bKey, "content-type": "application/json" }, body: JSON.stringify({ templateID: "nobody-none", network: { allowOut: ["10.0.0.0/8"] } }) });
  const text = await res.body.text();
  assert.equal(res.statusCode, 403, text);
  assert.match(text, /only the operator's key/);
});

test("the overlap rule: a range meets a refused one when either holds the other", () => {
  assert.throws(() => checkOpenings({ allow_out: ["172.0.0.0/8"] }, false), /forbidden|operator/); // holds 172.16.0.0/12
  assert.throws(() => checkOpenings({ allow_out: ["172.20.1.0/24"] }, false), /operator/); // inside it
  assert.doesNotThrow(() => checkOpenings({ allow_out: ["172.32.0.0/11"] }, false)); // beside it
  assert.doesNotThrow(() => checkOpenings({ allow_out: ["10.0.0.0/8"] }, true));
});
