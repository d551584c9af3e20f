// An undici connector that judges every address it connects to with Kiln's one outbound classifier
// (addresses.ts): a literal IP before the socket opens, a name by every address it resolves to, at each connect —
// so redirects, a token realm or a name that rebinds to loopback all meet the same check. Never-allowed addresses
// (link-local, metadata, …) are refused always; private and loopback ones only for hosts the caller allows.

import { lookup as dnsLookup } from "node:dns";
import type { LookupAddress, LookupOptions } from "node:dns";
import { isIP } from "node:net";
import { buildConnector } from "undici";
import { addressProblem } from "./addresses.ts";

export interface GuardedConnectOptions {
  /** Whether private and loopback addresses may be reached for this host (`hostname` without brackets, `port` as in the URL or its default). */
  allowPrivate(hostname: string, port: number): boolean;
  /** The error a refusal becomes (its message names the host and why). */
  refused(message: string): Error;
  /** Connect timeout, ms. */
  timeout?: number;
}

type LookupCallback = (err: NodeJS.ErrnoException | null, address: string | LookupAddress[], family?: number) => void;

function guardedLookup(allowPrivate: boolean, refused: (message: string) => Error) {
  return (hostname: string, options: LookupOptions, callback: LookupCallback) => {
    dnsLookup(hostname, { ...options, all: true }, (err, addresses) => {
      if (err) return callback(err, "");
      for (const a of addresses) {
        const problem = addressProblem(a.address, allowPrivate);
        if (problem) return callback(refused(`${hostname}: ${problem}`) as NodeJS.ErrnoException, "");
      }
      if (options.all) return callback(null, addresses);
      const first = addresses[0];
      if (!first) return callback(Object.assign(new Error(`${hostname} has no address`), { code: "ENOTFOUND" }), "");
      callback(null, first.address, first.family);
    });
  };
}

export function guardedConnector(opts: GuardedConnectOptions): buildConnector.connector {
  const strict = buildConnector({ timeout: opts.timeout, lookup: guardedLookup(false, opts.refused) });
  const lenient = buildConnector({ timeout: opts.timeout, lookup: guardedLookup(true, opts.refused) });
  return (options, callback) => {
    const hostname = options.hostname.replace(/^\[(.*)\]$/, "$1");
    const port = Number(options.port) || (options.protocol === "https:" ? 443 : 80);
    const allowPrivate = opts.allowPrivate(hostname, port);
    // A literal address is never looked up, so it is judged here.
    if (isIP(hostname)) {
      const problem = addressProblem(hostname, allowPrivate);
      if (problem) return callback(opts.refused(`${hostname}: ${problem}`), null);
    }
    (allowPrivate ? lenient : strict)(options, callback);
  };
}
