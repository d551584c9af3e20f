// CIDR text as machines' egress rules take it: parsed and put in one canonical form, for IPv4 and IPv6.
// Pure, so the API's validation and the driver's rules agree on what a CIDR is.

import { isIPv4, isIPv6 } from "node:net";

export type Cidr = { cidr: string; family: 4 | 6 };

/** `a.b.c.d/n` or an IPv6 prefix; a bare address means that one host. Returns the canonical text, or an error. */
export function parseCidr(text: string): Cidr | { error: string } {
  const [addr, len, ...rest] = text.split("/");
  const family = isIPv4(addr) ? 4 : isIPv6(addr) ? 6 : 0;
  if (!family || rest.length > 0) return { error: `${JSON.stringify(text)} is not a CIDR (like 10.0.0.0/8, 192.0.2.7 or 2001:db8::/32)` };
  const max = family === 4 ? 32 : 128;
  if (len === undefined) return { cidr: `${addr}/${max}`, family };
  if (!/^\d{1,3}$/.test(len) || Number(len) > max) return { error: `${JSON.stringify(text)} has a prefix length outside 0–${max}` };
  return { cidr: `${addr}/${Number(len)}`, family };
}
