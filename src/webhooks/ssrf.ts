// Which receiver addresses a delivery may reach: link-local and cloud metadata never, private and loopback only
// when KILN_WEBHOOK_ALLOW_PRIVATE=1. Checked on the address actually connected to, resolved at each attempt.

import { lookup as dnsLookup } from "node:dns";
import type { LookupAddress, LookupOptions } from "node:dns";
import { BlockList, isIP } from "node:net";

/** Never a webhook receiver: link-local (cloud metadata lives there), unspecified, multicast, broadcast. */
const ALWAYS_REFUSED = new BlockList();
ALWAYS_REFUSED.addSubnet("0.0.0.0", 8, "ipv4");
ALWAYS_REFUSED.addSubnet("169.254.0.0", 16, "ipv4");
ALWAYS_REFUSED.addAddress("100.100.100.200", "ipv4"); // Alibaba Cloud metadata
ALWAYS_REFUSED.addSubnet("224.0.0.0", 4, "ipv4");
ALWAYS_REFUSED.addSubnet("240.0.0.0", 4, "ipv4");
ALWAYS_REFUSED.addAddress("::", "ipv6");
ALWAYS_REFUSED.addSubnet("fe80::", 10, "ipv6");
ALWAYS_REFUSED.addAddress("fd00:ec2::254", "ipv6"); // AWS metadata over IPv6
ALWAYS_REFUSED.addSubnet("ff00::", 8, "ipv6");

/** Reachable only with KILN_WEBHOOK_ALLOW_PRIVATE=1: loopback, RFC 1918, shared address space, unique local. */
const PRIVATE = new BlockList();
PRIVATE.addSubnet("127.0.0.0", 8, "ipv4");
PRIVATE.addSubnet("10.0.0.0", 8, "ipv4");
PRIVATE.addSubnet("172.16.0.0", 12, "ipv4");
PRIVATE.addSubnet("192.168.0.0", 16, "ipv4");
PRIVATE.addSubnet("100.64.0.0", 10, "ipv4");
PRIVATE.addSubnet("198.18.0.0", 15, "ipv4");
PRIVATE.addAddress("::1", "ipv6");
PRIVATE.addSubnet("fc00::", 7, "ipv6");

/** An IPv4 address hidden in an IPv4-mapped IPv6 one (`::ffff:127.0.0.1`, `::ffff:7f00:1`) is checked as IPv4. */
function unmapped(address: string): { address: string; family: "ipv4" | "ipv6" } {
  const lower = address.toLowerCase();
  const dotted = /^(?:0{0,4}:){0,5}:?ffff:(\d+\.\d+\.\d+\.\d+)$/.exec(lower);
  if (dotted) return { address: dotted[1], family: "ipv4" };
  const hex = /^(?:0{0,4}:){0,5}:?ffff:([0-9a-f]{1,4}):([0-9a-f]{1,4})$/.exec(lower);
  if (hex) {
    const hi = parseInt(hex[1], 16);
    const lo = parseInt(hex[2], 16);
    return { address: `${hi >> 8}.${hi & 255}.${lo >> 8}.${lo & 255}`, family: "ipv4" };
  }
  return { address, family: isIP(address) === 4 ? "ipv4" : "ipv6" };
}

/** Why a delivery may not connect to this IP address, or null when it may. */
export function addressProblem(ip: string, allowPrivate: boolean): string | null {
  const { address, family } = unmapped(ip);
  if (ALWAYS_REFUSED.check(address, family)) return `the receiver address ${ip} is link-local, metadata or otherwise unroutable, and is never allowed`;
  if (!allowPrivate && PRIVATE.check(address, family)) return `the receiver address ${ip} is private or loopback (set KILN_WEBHOOK_ALLOW_PRIVATE=1 to allow it)`;
  return null;
}

export class ReceiverRefusedError extends Error {
  readonly code = "ERR_KILN_RECEIVER_REFUSED";
}

/** The host part of a URL as an IP literal (brackets of IPv6 removed), or null when it is a name. */
export function ipLiteral(hostname: string): string | null {
  const bare = hostname.startsWith("[") && hostname.endsWith("]") ? hostname.slice(1, -1) : hostname;
  return isIP(bare) ? bare : null;
}

type LookupCallback = (err: NodeJS.ErrnoException | null, address: string | LookupAddress[], family?: number) => void;

/**
 * A `lookup` for net.connect (undici's connect option) that resolves as usual, then refuses the connection when any
 * resolved address is not allowed — so a name that resolves to a metadata address never gets a request.
 */
export function guardedLookup(allowPrivate: boolean) {
  return (hostname: string, options: LookupOptions, callback: LookupCallback) => {
    dnsLookup(hostname, { ...options, all: true }, (err, addresses) => {
      if (err) return callback(err, "");
      for (const a of addresses) {
        const problem = addressProblem(a.address, allowPrivate);
        if (problem) return callback(new ReceiverRefusedError(`${hostname}: ${problem}`), "");
      }
      if (options.all) return callback(null, addresses);
      const first = addresses[0];
      if (!first) return callback(Object.assign(new Error(`${hostname} has no address`), { code: "ENOTFOUND" }), "");
      callback(null, first.address, first.family);
    });
  };
}
