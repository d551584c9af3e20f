// Which addresses Kiln's own outbound connections may reach (webhook receivers today): one classifier, so every
// place that judges an address judges it the same way, IPv6 forms that carry an IPv4 address by the address they carry.

import { isIP } from "node:net";
import { bigIntToV4, v4ToBigInt, v6ToBigInt } from "../runtime/cidr.ts";

/** `always`: a public address. `private`: only where private addresses are allowed. `never`: under no setting. */
export type AddressClass = "always" | "private" | "never";

export interface AddressVerdict {
  class: AddressClass;
  /** The range that decided it (`127.0.0.0/8`), when not `always`. */
  range?: string;
  /** For an IPv6 address that carries an IPv4 one: the IPv4 address and how it is carried (`NAT64 64:ff9b::/96`). */
  embedded?: { ipv4: string; form: string };
}

/** Never reachable: unspecified, link-local (cloud metadata lives there), metadata addresses, multicast, reserved. */
export const NEVER_V4 = ["0.0.0.0/8", "169.254.0.0/16", "100.100.100.200/32", "224.0.0.0/4", "240.0.0.0/4"];
export const NEVER_V6 = ["::/128", "fe80::/10", "fd00:ec2::254/128", "ff00::/8"];
/** Reachable only where private addresses are allowed: loopback, RFC 1918, shared address space, benchmarking, ULA. */
export const PRIVATE_V4 = ["127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "198.18.0.0/15"];
export const PRIVATE_V6 = ["::1/128", "fc00::/7"];

interface Embedding {
  prefix: string;
  form: string;
  /** The IPv4 addresses the IPv6 one carries (Teredo carries two: its server and, inverted, the client). */
  carried: (n: bigint) => bigint[];
  /** A network-specific prefix is at least private, whatever it carries. */
  atLeast?: AddressClass;
}

const low32 = (n: bigint) => [n & 0xffffffffn];

/**
 * IPv6 ranges whose addresses carry an IPv4 address (RFC 4291, 6145, 6052, 8215, 3056, 4380): a connection to one can
 * end at that IPv4 address (the kernel for mapped ones, a translator or relay for the others), so it is judged by it.
 * `::/96` (IPv4-compatible) is checked after `::` and `::1`, which sit inside it but mean themselves.
 */
const EMBEDDINGS: Embedding[] = [
  { prefix: "::ffff:0:0/96", form: "IPv4-mapped", carried: low32 },
  { prefix: "::ffff:0:0:0/96", form: "IPv4-translated", carried: low32 },
  { prefix: "64:ff9b::/96", form: "NAT64", carried: low32 },
  { prefix: "64:ff9b:1::/48", form: "local-use NAT64", carried: low32, atLeast: "private" },
  { prefix: "2002::/16", form: "6to4", carried: (n) => [(n >> 80n) & 0xffffffffn] },
  { prefix: "2001::/32", form: "Teredo", carried: (n) => [(n >> 64n) & 0xffffffffn, ~n & 0xffffffffn] },
  { prefix: "::/96", form: "IPv4-compatible", carried: low32 },
];

type Range = { text: string; base: bigint; mask: bigint };

function range(cidr: string, bits: 32 | 128): Range {
  const [addr, len] = cidr.split("/");
  const value = bits === 32 ? v4ToBigInt(addr) : v6ToBigInt(addr);
  const all = (1n << BigInt(bits)) - 1n;
  const mask = all ^ ((1n << BigInt(bits - Number(len))) - 1n);
  return { text: cidr, base: value & mask, mask };
}

const V4: { class: AddressClass; ranges: Range[] }[] = [
  { class: "never", ranges: NEVER_V4.map((c) => range(c, 32)) },
  { class: "private", ranges: PRIVATE_V4.map((c) => range(c, 32)) },
];
const V6: { class: AddressClass; ranges: Range[] }[] = [
  { class: "never", ranges: NEVER_V6.map((c) => range(c, 128)) },
  { class: "private", ranges: PRIVATE_V6.map((c) => range(c, 128)) },
];
const EMBEDDED = EMBEDDINGS.map((e) => ({ ...e, range: range(e.prefix, 128) }));
const EXACT_V6 = [range("::/128", 128), range("::1/128", 128)];
const RANK: Record<AddressClass, number> = { always: 0, private: 1, never: 2 };

function lookupIn(table: typeof V4, n: bigint): { class: AddressClass; range?: string } {
  for (const group of table) for (const r of group.ranges) if ((n & r.mask) === r.base) return { class: group.class, range: r.text };
  return { class: "always" };
}

/** The class of an IP address (IPv4 or IPv6 text, an IPv6 zone ignored); anything that is not an IP is `never`. */
export function classifyAddress(ip: string): AddressVerdict {
  const bare = ip.replace(/%.*$/, "");
  const family = isIP(bare);
  if (family === 4) return lookupIn(V4, v4ToBigInt(bare));
  if (family !== 6) return { class: "never", range: "not an IP address" };
  const n = v6ToBigInt(bare.toLowerCase());
  if (!EXACT_V6.some((r) => (n & r.mask) === r.base)) {
    for (const e of EMBEDDED) {
      if ((n & e.range.mask) !== e.range.base) continue;
      // The worst of what it carries decides; a network-specific prefix is at least what it says.
      let worst: AddressVerdict = { class: e.atLeast ?? "always", range: e.atLeast ? e.prefix : undefined };
      for (const v4 of e.carried(n)) {
        const inner = lookupIn(V4, v4);
        if (inner.class !== "always" && RANK[inner.class] >= RANK[worst.class]) worst = { class: inner.class, range: inner.range, embedded: { ipv4: bigIntToV4(v4), form: `${e.form} ${e.prefix}` } };
      }
      return worst;
    }
  }
  return lookupIn(V6, n);
}

/** Why a connection may not go to this IP address, or null when it may. */
export function addressProblem(ip: string, allowPrivate: boolean): string | null {
  const v = classifyAddress(ip);
  if (v.class === "always" || (v.class === "private" && allowPrivate)) return null;
  const carried = v.embedded ? ` (it carries ${v.embedded.ipv4} as ${v.embedded.form})` : "";
  if (v.class === "never") return `the address ${ip}${carried} is link-local, metadata or otherwise unroutable (${v.range}), and is never allowed`;
  return `the address ${ip}${carried} is private or loopback (${v.range})`;
}

/**
 * Every range a host-side filter must refuse for traffic that may reach neither private nor never-allowed addresses
 * (machines' egress, in nftables interval sets): the IPv4 and IPv6 ranges above, and the IPv6 forms carrying them —
 * NAT64 and 6to4 range by range (both carry public addresses too), the other carrying forms whole (nothing public
 * is reached through them: IPv4-compatible, mapped and translated addresses, local-use NAT64, Teredo). No range
 * lies inside another (interval sets refuse overlaps).
 */
export function refusedCidrs(): { v4: string[]; v6: string[] } {
  const v4 = [...NEVER_V4, ...PRIVATE_V4];
  const v6 = [...NEVER_V6, ...PRIVATE_V6, "::/96", "::ffff:0:0/96", "::ffff:0:0:0/96", "64:ff9b:1::/48", "2001::/32"];
  const hex = (n: bigint) => [(n >> 16n) & 0xffffn, n & 0xffffn].map((g) => g.toString(16)).join(":");
  for (const cidr of v4) {
    const [addr, len] = cidr.split("/");
    const n = v4ToBigInt(addr);
    v6.push(`64:ff9b::${hex(n)}/${96 + Number(len)}`, `2002:${hex(n)}::/${16 + Number(len)}`);
  }
  return { v4: outermost(v4, 32), v6: outermost(v6, 128) };
}

let refused: { v4: Range[]; v6: Range[] } | undefined;

/**
 * The refused range (refusedCidrs) that a canonical CIDR meets — either holding the other — or undefined: what
 * opening it in a machine's egress would open beyond the default.
 */
export function refusedRangeMet(cidr: string, family: 4 | 6): string | undefined {
  refused ??= (() => {
    const { v4, v6 } = refusedCidrs();
    return { v4: v4.map((c) => range(c, 32)), v6: v6.map((c) => range(c, 128)) };
  })();
  const want = range(cidr, family === 4 ? 32 : 128);
  return (family === 4 ? refused.v4 : refused.v6).find((r) => (r.base & want.mask & r.mask) === (want.base & r.mask & want.mask))?.text;
}

/** The CIDRs of a list that no other CIDR of it contains. */
function outermost(list: string[], bits: 32 | 128): string[] {
  const ranges = [...new Set(list)].map((c) => ({ ...range(c, bits), len: Number(c.split("/")[1]) }));
  return ranges.filter((r) => !ranges.some((o) => o !== r && o.len <= r.len && (r.base & o.mask) === o.base && !(o.len === r.len && o.text > r.text))).map((r) => r.text);
}
