// Machines' egress policy, enforced on the host where machine root cannot reach it. A machine's outbound traffic
// leaves through its slirp4netns, a host process that opens ordinary host sockets for it; each slirp4netns runs in
// its own cgroup v2 directory, and Kiln's own nftables table (`inet kiln`, nothing else is touched) filters the
// sockets of those cgroups: never the host's own addresses, link-local or private ranges (the host's DNS resolvers
// on port 53, and host loopback for host.kiln.internal when host access is on, excepted); per machine, `allow_out`
// opens and `deny_out` closes ranges (allow_out wins where both match, so deny 0.0.0.0/0 + allow X is an allow list).

import { execHost } from "../host-commands.ts";
import { existsSync, readFileSync } from "node:fs";
import { mkdir, readFile, rm, rmdir, writeFile } from "node:fs/promises";
import { isIPv4, isIPv6 } from "node:net";
import { parseCidr } from "../cidr.ts";
import { refusedCidrs } from "../../net/addresses.ts";
import type { Cidr } from "../cidr.ts";
import type { EgressRules } from "../driver.ts";
import { join } from "node:path";

export const TABLE = "kiln";
/** Level 1 of the cgroup v2 tree under which every machine's slirp4netns runs. */
const EGRESS_CGROUP = "kiln-egress";
/** Level 2: whether host loopback (host.kiln.internal) is reachable. Level 3 is the machine. */
const GROUPS = { hostAccess: "host-access", isolated: "isolated" } as const;

// Kiln's one outbound-address classifier decides what is private or never reachable, IPv6 forms carrying IPv4 included.
const { v4: BLOCKED_V4, v6: BLOCKED_V6 } = refusedCidrs();

/** Where the cgroup v2 hierarchy is mounted (its own mount on hybrid v1+v2 hosts), or undefined without one. */
function cgroupV2Root(): { path: string; nftPrefix: string } | undefined {
  if (existsSync("/sys/fs/cgroup/cgroup.controllers")) return { path: "/sys/fs/cgroup", nftPrefix: "" };
  if (existsSync("/sys/fs/cgroup/unified/cgroup.controllers")) return { path: "/sys/fs/cgroup/unified", nftPrefix: "unified/" };
  return undefined;
}

/** The host's resolvers, which slirp4netns forwards the machine's DNS (10.0.2.3) to: private or loopback, often. */
function resolvers(): { v4: string[]; v6: string[] } {
  let text = "";
  try {
    text = readFileSync("/etc/resolv.conf", "utf8");
  } catch {
    // no resolvers: DNS in machines will not work, as on the host
  }
  const servers = [...text.matchAll(/^\s*nameserver\s+(\S+)/gm)].map((m) => m[1].replace(/%.*$/, ""));
  return { v4: servers.filter((s) => isIPv4(s)), v6: servers.filter((s) => isIPv6(s)) };
}

/** Started by the host command helper (host-commands.ts), the script on its stdin. */
async function nft(script: string): Promise<void> {
  await execHost("nft", ["-f", "-"], { input: script }).catch((err: unknown) => {
    const e = err as { code?: unknown; stderr?: string; message: string };
    if (e.code === "ENOENT") throw new Error(`nft could not be run (apt-get install nftables): ${e.message}`);
    throw new Error(`nft failed: ${(e.stderr ?? "").trim().split("\n").slice(0, 3).join(" ")}`);
  });
}

const REJECT = "meta l4proto tcp reject with tcp reset";
const REJECT_OTHER = "reject with icmpx port-unreachable";

function elements(list: string[]): string {
  return `{ ${list.join(", ")} }`;
}

export interface Egress {
  /** Sets up (or refreshes, atomically) Kiln's table; keeps what running machines added to it. */
  ensure(): Promise<void>;
  /**
   * The cgroup.procs file a machine's slirp4netns must move into before it opens any socket. `accept` opens single
   * address:port pairs (TCP) the policy would refuse: a Dockerfile build's builder reaching a registry the operator
   * listed in KILN_INSECURE_REGISTRIES, and nothing else on that host.
   */
  prepare(id: string, hostAccess: boolean, policy: EgressRules | undefined, marker: string, accept?: { address: string; port: number }[]): Promise<string>;
  /** Removes the machine's rules and cgroup once its slirp4netns is gone. Idempotent. */
  release(id: string, marker: string): Promise<void>;
  /**
   * Replaces a live machine's allow/deny lists (its cgroup stays, its slirp4netns stays in it): one nft transaction
   * each way, so a connection is judged by the old lists or the new, never by none. False when the machine has no
   * egress cgroup (no internet, or not running).
   */
  update(id: string, hostAccess: boolean, policy: EgressRules | undefined, marker: string): Promise<boolean>;
  /** How egress is filtered, for readiness. */
  describe(): string;
}

export function createEgress(): Egress {
  const root = cgroupV2Root();
  let ensured: Promise<void> | undefined;

  const nftName = (id: string) => `m_${id.replace(/[^A-Za-z0-9_]/g, "_")}`;
  const groupOf = (hostAccess: boolean) => (hostAccess ? GROUPS.hostAccess : GROUPS.isolated);
  const cgroupDir = (group: string, id: string) => join(root!.path, EGRESS_CGROUP, group, id);
  const nftCgroup = (group: string, id: string) => `"${root!.nftPrefix}${EGRESS_CGROUP}/${group}/${id}"`;

  async function setUp() {
    if (!root) throw new Error("no cgroup v2 hierarchy is mounted: machines' egress cannot be filtered");
    await Promise.all(Object.values(GROUPS).map((g) => mkdir(join(root.path, EGRESS_CGROUP, g), { recursive: true })));
    const dns = resolvers();
    const prefix = root.nftPrefix;
    const script = [
      `add table inet ${TABLE}`,
      `add set inet ${TABLE} blocked4 { type ipv4_addr; flags interval; }`,
      `flush set inet ${TABLE} blocked4`,
      `add element inet ${TABLE} blocked4 ${elements(BLOCKED_V4)}`,
      `add set inet ${TABLE} blocked6 { type ipv6_addr; flags interval; }`,
      `flush set inet ${TABLE} blocked6`,
      `add element inet ${TABLE} blocked6 ${elements(BLOCKED_V6)}`,
      `add set inet ${TABLE} dns4 { type ipv4_addr; }`,
      `flush set inet ${TABLE} dns4`,
      ...(dns.v4.length ? [`add element inet ${TABLE} dns4 ${elements(dns.v4)}`] : []),
      `add set inet ${TABLE} dns6 { type ipv6_addr; }`,
      `flush set inet ${TABLE} dns6`,
      ...(dns.v6.length ? [`add element inet ${TABLE} dns6 ${elements(dns.v6)}`] : []),
      // Machines with their own allow/deny lists: the machine's cgroup (level 3) → a jump to its chain.
      `add map inet ${TABLE} machines { type cgroupsv2 : verdict; }`,
      `add chain inet ${TABLE} egress`,
      `flush chain inet ${TABLE} egress`,
      `add rule inet ${TABLE} egress ip daddr @dns4 meta l4proto { tcp, udp } th dport 53 accept`,
      `add rule inet ${TABLE} egress ip6 daddr @dns6 meta l4proto { tcp, udp } th dport 53 accept`,
      `add rule inet ${TABLE} egress socket cgroupv2 level 3 vmap @machines`,
      `add rule inet ${TABLE} egress socket cgroupv2 level 2 "${prefix}${EGRESS_CGROUP}/${GROUPS.hostAccess}" ip daddr 127.0.0.1 accept`,
      `add rule inet ${TABLE} egress socket cgroupv2 level 2 "${prefix}${EGRESS_CGROUP}/${GROUPS.hostAccess}" ip6 daddr ::1 accept`,
      // Every address of the host, whatever interface it is on.
      `add rule inet ${TABLE} egress fib daddr type local ${REJECT}`,
      `add rule inet ${TABLE} egress fib daddr type local ${REJECT_OTHER}`,
      `add rule inet ${TABLE} egress ip daddr @blocked4 ${REJECT}`,
      `add rule inet ${TABLE} egress ip daddr @blocked4 ${REJECT_OTHER}`,
      `add rule inet ${TABLE} egress ip6 daddr @blocked6 ${REJECT}`,
      `add rule inet ${TABLE} egress ip6 daddr @blocked6 ${REJECT_OTHER}`,
      `add chain inet ${TABLE} output { type filter hook output priority 0; policy accept; }`,
      `flush chain inet ${TABLE} output`,
      `add rule inet ${TABLE} output socket cgroupv2 level 1 "${prefix}${EGRESS_CGROUP}" jump egress`,
    ].join("\n");
    await nft(script + "\n");
  }

  function ensure(): Promise<void> {
    ensured ??= setUp().catch((err: unknown) => {
      ensured = undefined; // try again on the next machine: nftables may be installed meanwhile
      throw err;
    });
    return ensured;
  }

  async function prepare(id: string, hostAccess: boolean, policy: EgressRules | undefined, marker: string, accept: { address: string; port: number }[] = []): Promise<string> {
    await ensure();
    const group = groupOf(hostAccess);
    const dir = cgroupDir(group, id);
    await mkdir(dir, { recursive: true });
    const rules = Boolean((policy && (policy.allowOut.length || policy.denyOut.length)) || accept.length);
    // The marker says where the cgroup is and whether rules were added, so release() needs no listing of the table.
    await writeFile(marker, JSON.stringify({ group, rules }));
    if (rules) {
      policy ??= { allowOut: [], denyOut: [] };
      const name = nftName(id);
      const split = (list: string[]) => {
        const parsed = list.map(parseCidr).filter((c): c is Cidr => "cidr" in c);
        return { v4: parsed.filter((c) => c.family === 4).map((c) => c.cidr), v6: parsed.filter((c) => c.family === 6).map((c) => c.cidr) };
      };
      const allow = split(policy.allowOut);
      const deny = split(policy.denyOut);
      const lines: string[] = [];
      const set = (suffix: string, type: string, list: string[]) => {
        lines.push(`add set inet ${TABLE} ${name}_${suffix} { type ${type}; flags interval; auto-merge; }`, `flush set inet ${TABLE} ${name}_${suffix}`);
        if (list.length) lines.push(`add element inet ${TABLE} ${name}_${suffix} ${elements(list)}`);
      };
      set("allow4", "ipv4_addr", allow.v4);
      set("allow6", "ipv6_addr", allow.v6);
      set("deny4", "ipv4_addr", deny.v4);
      set("deny6", "ipv6_addr", deny.v6);
      lines.push(`add chain inet ${TABLE} ${name}`, `flush chain inet ${TABLE} ${name}`);
      for (const a of accept) {
        if (!Number.isInteger(a.port) || a.port < 1 || a.port > 65535) continue;
        if (isIPv4(a.address)) lines.push(`add rule inet ${TABLE} ${name} ip daddr ${a.address} tcp dport ${a.port} accept`);
        else if (isIPv6(a.address)) lines.push(`add rule inet ${TABLE} ${name} ip6 daddr ${a.address} tcp dport ${a.port} accept`);
      }
      lines.push(
        `add rule inet ${TABLE} ${name} ip daddr @${name}_allow4 accept`,
        `add rule inet ${TABLE} ${name} ip6 daddr @${name}_allow6 accept`,
        `add rule inet ${TABLE} ${name} ip daddr @${name}_deny4 ${REJECT}`,
        `add rule inet ${TABLE} ${name} ip daddr @${name}_deny4 ${REJECT_OTHER}`,
        `add rule inet ${TABLE} ${name} ip6 daddr @${name}_deny6 ${REJECT}`,
        `add rule inet ${TABLE} ${name} ip6 daddr @${name}_deny6 ${REJECT_OTHER}`,
        `add element inet ${TABLE} machines { ${nftCgroup(group, id)} : jump ${name} }`,
      );
      await nft(lines.join("\n") + "\n");
    }
    return join(dir, "cgroup.procs");
  }

  async function killMembers(procs: string): Promise<void> {
    const pids = (await readFile(procs, "utf8").catch(() => "")).split("\n").filter(Boolean).map(Number);
    for (const pid of pids) {
      try {
        process.kill(pid, "SIGKILL");
      } catch {
        // gone meanwhile
      }
    }
  }

  async function release(id: string, marker: string): Promise<void> {
    if (!root) return;
    const recorded = await readFile(marker, "utf8").catch(() => "");
    if (!recorded) return;
    const { group, rules } = JSON.parse(recorded) as { group: string; rules: boolean };
    const dir = cgroupDir(group, id);
    if (rules) {
      const name = nftName(id);
      const sets = ["allow4", "allow6", "deny4", "deny6"].map((s) => `delete set inet ${TABLE} ${name}_${s}`);
      const element = existsSync(dir) ? [`delete element inet ${TABLE} machines { ${nftCgroup(group, id)} }`] : [];
      // One transaction; if part was already gone (a release cut short), each piece on its own.
      await nft([...element, `delete chain inet ${TABLE} ${name}`, ...sets].join("\n") + "\n").catch(async () => {
        for (const line of [...element, `delete chain inet ${TABLE} ${name}`, ...sets]) await nft(line + "\n").catch(() => undefined);
      });
    }
    // The cgroup empties once slirp4netns has exited; the kernel may take a moment after the kill to let it go. Only
    // this machine's network helper is ever put in it: one still there after a while (its pid file lost or stale,
    // as a crash can leave it) is killed from the cgroup's own list.
    for (let i = 0; existsSync(dir); i++) {
      try {
        await rmdir(dir);
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code === "ENOENT") break;
        if (i >= 200) throw new Error(`the egress cgroup ${dir} did not empty: ${(err as Error).message}`);
        if (i % 50 === 20) await killMembers(join(dir, "cgroup.procs"));
        await new Promise((r) => setTimeout(r, 10));
      }
    }
    await rm(marker, { force: true });
  }

  async function update(id: string, hostAccess: boolean, policy: EgressRules | undefined, marker: string): Promise<boolean> {
    const recorded = await readFile(marker, "utf8").catch(() => "");
    if (!root || !recorded) return false;
    if (policy && (policy.allowOut.length || policy.denyOut.length)) {
      await prepare(id, hostAccess, policy, marker); // flushes and refills the machine's sets and chain in place
      return true;
    }
    const { group, rules } = JSON.parse(recorded) as { group: string; rules: boolean };
    if (rules) {
      const name = nftName(id);
      const lines = [`delete element inet ${TABLE} machines { ${nftCgroup(group, id)} }`, `delete chain inet ${TABLE} ${name}`, ...["allow4", "allow6", "deny4", "deny6"].map((x) => `delete set inet ${TABLE} ${name}_${x}`)];
      // One transaction; if part of it was already gone, each piece on its own (as release does).
      await nft(lines.join("\n") + "\n").catch(async () => {
        for (const line of lines) await nft(line + "\n").catch(() => undefined);
      });
    }
    await writeFile(marker, JSON.stringify({ group, rules: false }));
    return true;
  }

  return {
    ensure,
    prepare,
    release,
    update,
    describe: () => (root ? `host nftables table inet ${TABLE} on each machine's slirp4netns cgroup (${root.path}/${EGRESS_CGROUP})` : "not filtered: no cgroup v2 hierarchy"),
  };
}
