// CIDRs as egress rules take them: canonical form, bare addresses as one host, and clear refusals.

import { test } from "node:test";
import assert from "node:assert/strict";
import { parseCidr } from "../../src/runtime/cidr.ts";

test("a CIDR is kept in canonical form; a bare address is one host", () => {
  assert.deepEqual(parseCidr("10.0.0.0/8"), { cidr: "10.0.0.0/8", family: 4 });
  assert.deepEqual(parseCidr("192.0.2.7"), { cidr: "192.0.2.7/32", family: 4 });
  assert.deepEqual(parseCidr("0.0.0.0/00"), { cidr: "0.0.0.0/0", family: 4 });
  assert.deepEqual(parseCidr("2001:db8::/32"), { cidr: "2001:db8::/32", family: 6 });
  assert.deepEqual(parseCidr("::1"), { cidr: "::1/128", family: 6 });
});

test("host bits are cleared: a CIDR names its network", () => {
  assert.deepEqual(parseCidr("10.1.2.3/8"), { cidr: "10.0.0.0/8", family: 4 });
  assert.deepEqual(parseCidr("192.0.2.200/25"), { cidr: "192.0.2.128/25", family: 4 });
  assert.deepEqual(parseCidr("2001:db8::1/32"), { cidr: "2001:db8:0:0:0:0:0:0/32", family: 6 });
  assert.deepEqual(parseCidr("::ffff:10.1.2.3/120"), { cidr: "0:0:0:0:0:ffff:a01:200/120", family: 6 });
});

test("what is not a CIDR is refused with a reason", () => {
  for (const bad of ["", "10.0.0.0/33", "2001:db8::/129", "10.0.0/8", "example.com", "1.2.3.4/8/9", "1.2.3.4/-1", "1.2.3.4/ 8", "10.0.0.0/8 ", "1.2.3.4/1e1"]) {
    assert.ok("error" in parseCidr(bad), `${JSON.stringify(bad)} is refused`);
  }
});
