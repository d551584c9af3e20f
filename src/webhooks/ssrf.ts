// Which receiver addresses a delivery may reach: link-local and cloud metadata never, private and loopback only
// when KILN_WEBHOOK_ALLOW_PRIVATE=1 or the webhook has allow_private (set with the operator's key). Checked on the address actually connected to, resolved at each attempt; the
// classification itself is Kiln's one outbound-address classifier (src/net/addresses.ts).

import { lookup as dnsLookup } from "node:dns";
import type { LookupAddress, LookupOptions } from "node:dns";
import { isIP } from "node:net";
import { classifyAddress, addressProblem as outboundProblem } from "../net/addresses.ts";

/** Why a delivery may not connect to this IP address, or null when it may. */
export function addressProblem(ip: string, allowPrivate: boolean): string | null {
  const problem = outboundProblem(ip, allowPrivate);
  if (!problem) return null;
  const hint = classifyAddress(ip).class === "private" ? "; set KILN_WEBHOOK_ALLOW_PRIVATE=1, or allow_private: true on the webhook with the operator's key, to allow it" : "";
  return problem.replace(/^the address /, "the receiver address ") + hint;
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
/** dns.lookup with `all: true`, replaceable in tests (a name that resolves to an address DNS here cannot give). */
export type Resolve = (hostname: string, options: LookupOptions & { all: true }, callback: (err: NodeJS.ErrnoException | null, addresses: LookupAddress[]) => void) => void;

/**
 * A `lookup` for net.connect (undici's connect option) that resolves as usual, then refuses the connection when any
 * resolved address is not allowed — so a name that resolves to a metadata address never gets a request.
 */
export function guardedLookup(allowPrivate: boolean, resolve: Resolve = dnsLookup as unknown as Resolve) {
  return (hostname: string, options: LookupOptions, callback: LookupCallback) => {
    resolve(hostname, { ...options, all: true }, (err, addresses) => {
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
