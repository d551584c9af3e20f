// E2B's sandbox network rules onto Kiln's egress policy (allow_out / deny_out CIDR lists, docs/DESIGN-NOTES.md, on top of
// the default that closes the host, link-local and private ranges). E2B's order holds in Kiln's chain: an allowed
// destination wins over a denied one. What Kiln's egress has no counterpart for is refused, never ignored.

import { Type } from "typebox";
import type { Static } from "typebox";
import { KilnError } from "../../errors.ts";
import { parseCidr } from "../../runtime/cidr.ts";

const Destinations = Type.Array(Type.String({ minLength: 1, maxLength: 256 }), { maxItems: 256 });

/** E2B's SandboxNetworkConfig (create) and SandboxNetworkUpdateConfig (PUT …/network), as the SDK sends them. */
export const E2bNetwork = Type.Object(
  {
    allowOut: Type.Optional(Destinations),
    denyOut: Type.Optional(Destinations),
    allowPublicTraffic: Type.Optional(Type.Boolean()),
    maskRequestHost: Type.Optional(Type.String()),
    httpsPorts: Type.Optional(Type.Array(Type.Integer())),
    rules: Type.Optional(Type.Unknown()),
    egressProxy: Type.Optional(Type.Unknown()),
    allow_internet_access: Type.Optional(Type.Boolean()),
  },
  { additionalProperties: false },
);
export type E2bNetworkBody = Static<typeof E2bNetwork>;

function bad(message: string): never {
  throw new KilnError("invalid_request", message);
}

/** CIDRs and bare addresses pass (a bare one is that host); a domain name is refused with the reason. */
function cidrs(list: string[] | undefined, field: string): string[] {
  return (list ?? []).map((entry, i) => {
    if ("error" in parseCidr(entry)) bad(`network.${field}[${i}]: ${JSON.stringify(entry)} is not an IP address or CIDR; Kiln's egress policy filters addresses, not domain names`);
    return entry;
  });
}

/** Kiln's egress lists for an E2B network config; undefined when it sets none. */
export function egressOf(network: E2bNetworkBody | null | undefined): { allow_out: string[]; deny_out: string[] } | undefined {
  if (!network) return undefined;
  if (network.allowPublicTraffic === true) bad("network.allowPublicTraffic true is not supported by Kiln: a sandbox's ports always need its traffic token (e2b-traffic-access-token)");
  if (network.maskRequestHost !== undefined) bad("network.maskRequestHost is not supported by Kiln");
  if (network.httpsPorts !== undefined && network.httpsPorts.length > 0) bad("network.httpsPorts is not supported by Kiln: its port proxy speaks plain HTTP to the sandbox");
  if (network.rules !== undefined && network.rules !== null && !(typeof network.rules === "object" && Object.keys(network.rules).length === 0)) bad("network.rules (header injection into outbound requests) is not supported by Kiln");
  if (network.egressProxy !== undefined && network.egressProxy !== null) bad("network.egressProxy is not supported by Kiln");
  const allow = cidrs(network.allowOut, "allowOut");
  const deny = cidrs(network.denyOut, "denyOut");
  // PUT's allow_internet_access false is E2B's denyOut 0.0.0.0/0 (the sandbox keeps its network device).
  if (network.allow_internet_access === false) deny.push("0.0.0.0/0", "::/0");
  if (allow.length === 0 && deny.length === 0) return undefined;
  return { allow_out: allow, deny_out: deny };
}
