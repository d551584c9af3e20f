// Attacks on the multi-host surface and the operator's key (docs/hosts.md), driven from outside over HTTP: a stranger
// and a lesser key holder against /v1/hosts, forged cluster headers, and the operator's own key.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

let k: TestKiln;
let lesser: { id: string; key: string };
let operatorId: string;

before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  const made = await k.call("POST", "/v1/keys", { body: { name: "lesser" } });
  assert.equal(made.status, 201, made.text);
  lesser = { id: made.body.id, key: made.body.key };
  operatorId = (await k.call("GET", "/v1/keys")).body.keys.find((x: { name: string }) => x.name === "KILN_API_KEY").id;
});
after(async () => k?.close());

test("a stranger reaches no /v1/hosts route; forged cluster headers are refused whatever else the request carries", async () => {
  for (const [method, path] of [["GET", "/v1/hosts"], ["POST", `/v1/hosts/hst_x/drain`]] as const) assert.equal((await k.call(method, path, { key: null })).status, 401);
  const hostId = (await k.call("GET", "/v1/hosts")).body.hosts[0]?.id ?? "hst_none";
  const forged = { "x-kiln-cluster-from": "hst_evil", "x-kiln-cluster-to": hostId, "x-kiln-cluster-ts": String(Date.now()), "x-kiln-cluster-key": operatorId, "x-kiln-cluster-sig": "A".repeat(43) };
  // With a valid key beside them: the forged headers are still refused, never a fallback to the key.
  const res = await k.call("GET", "/v1/machines", { headers: forged });
  assert.equal(res.status, 401, res.text);
  assert.equal((await k.call("GET", "/health", { key: null, headers: forged })).status, 401, "even a public route refuses forged cluster headers");
});

test("a lesser key may not drain hosts, nor revoke the operator's key (which would take drain and allow_private from the operator)", async () => {
  const hostId = (await k.call("GET", "/v1/hosts", { key: lesser.key })).body.hosts[0].id;
  assert.equal((await k.call("POST", `/v1/hosts/${hostId}/drain`, { key: lesser.key })).status, 403);
  const revoke = await k.call("DELETE", `/v1/keys/${operatorId}`, { key: lesser.key });
  assert.equal(revoke.status, 403, `a lesser key revoked the operator's key: ${revoke.text}`);
  assert.equal(revoke.body.code, "forbidden");
  assert.equal((await k.call("GET", "/v1/keys")).status, 200, "the operator's key still works");
  // Keys other than the operator's stay equal: any key revokes them, the lesser one itself included.
  const other = (await k.call("POST", "/v1/keys", { key: lesser.key, body: { name: "other" } })).body;
  assert.equal((await k.call("DELETE", `/v1/keys/${other.id}`, { key: lesser.key })).status, 200);
  assert.equal((await k.call("DELETE", `/v1/keys/${lesser.id}`)).status, 200, "the operator revokes any key");
});
