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
  const bits = Number(len);
  // Host bits set (10.1.2.3/8) mean the network they are in (10.0.0.0/8), as nftables stores it.
  const value = family === 4 ? v4ToBigInt(addr) : v6ToBigInt(addr);
  const mask = ((1n << BigInt(max)) - 1n) ^ ((1n << BigInt(max - bits)) - 1n);
  if ((value & mask) === value) return { cidr: `${addr}/${bits}`, family };
  return { cidr: `${family === 4 ? bigIntToV4(value & mask) : bigIntToV6(value & mask)}/${bits}`, family };
}

export function v4ToBigInt(addr: string): bigint {
  return addr.split(".").reduce((acc, o) => (acc << 8n) | BigInt(Number(o)), 0n);
}

export function bigIntToV4(n: bigint): string {
  return [24n, 16n, 8n, 0n].map((s) => String((n >> s) & 255n)).join(".");
}

export function v6ToBigInt(addr: string): bigint {
  let text = addr;
  // An embedded IPv4 tail (::ffff:1.2.3.4) becomes two groups.
  const v4 = /(\d+\.\d+\.\d+\.\d+)$/.exec(text);
  if (v4) {
    const n = v4ToBigInt(v4[1]);
    text = text.slice(0, -v4[1].length) + `${(n >> 16n).toString(16)}:${(n & 0xffffn).toString(16)}`;
  }
  const [head, tail] = text.includes("::") ? text.split("::") : [text, undefined];
  const h = head ? head.split(":") : [];
  const t = tail ? tail.split(":") : [];
  const groups = tail === undefined ? h : [...h, ...Array(8 - h.length - t.length).fill("0"), ...t];
  return groups.reduce((acc, g) => (acc << 16n) | BigInt(parseInt(g, 16)), 0n);
}

export function bigIntToV6(n: bigint): string {
  return Array.from({ length: 8 }, (_, i) => ((n >> BigInt((7 - i) * 16)) & 0xffffn).toString(16)).join(":");
}
