// Whether a declarative step that exited non-zero may succeed if run again, read from its last lines of output:
// only a fetch step whose output shows a network failure is retried; a missing package or a 404 never is.

/** Output that says the thing asked for does not exist or does not match: the same request fails again. */
const PERMANENT: { pattern: RegExp; action: string }[] = [
  { pattern: /Unable to locate package|has no installation candidate|Package '.*' has no|E: Package .* is not available/, action: "check the package name (apt-cache search NAME in a machine of the parent template) and build again" },
  { pattern: /No matching distribution found|Could not find a version that satisfies/, action: "check the package name and version on the index pip uses, then build again" },
  { pattern: /npm (ERR!|error) (code E404|404)|is not in this registry|No matching version found/, action: "check the package name and version on the npm registry, then build again" },
  { pattern: /Repository not found|not found in upstream origin|Remote branch .* not found|does not appear to be a git repository/, action: "check the repository URL and branch, then build again" },
  { pattern: /returned error: 4\d\d|\b40[134] (Not Found|Forbidden|Unauthorized)\b/, action: "check the URL (the server answered that it has nothing there for us), then build again" },
  { pattern: /sha256sum: WARNING|: FAILED$|computed checksum did NOT match/m, action: "the download does not match its sha256: check the URL and the digest, then build again" },
];

/** Output that says the network let us down: worth another attempt. */
const NETWORK = /Temporary failure (resolving|in name resolution)|Could not resolve|Failed to connect|Connection (refused|reset|timed out)|Network is unreachable|No route to host|Operation timed out|timed out|E(CONNRESET|TIMEDOUT|AI_AGAIN|NOTFOUND|CONNREFUSED|NETUNREACH)|Hash Sum mismatch|Failed to fetch|returned error: 5\d\d|\b50[234] |curl: \((5|6|7|18|28|35|52|55|56)\)|early EOF|RPC failed/;

export interface StepExitJudgement {
  retryable: boolean;
  suggestedAction: string;
}

/** `transient`: the step fetches from the network (apt, pip, npm, git_clone, download). */
export function judgeStepExit(transient: boolean, lastLines: string[]): StepExitJudgement {
  const text = lastLines.join("\n");
  for (const p of PERMANENT) if (p.pattern.test(text)) return { retryable: false, suggestedAction: p.action };
  if (transient && NETWORK.test(text)) return { retryable: true, suggestedAction: "check the build machine's network (vm.internet, the mirror or registry it reaches) and build again" };
  return { retryable: false, suggestedAction: "fix the command of this step (its last lines of output are in error_detail.details.last_lines) and build again" };
}

/** The last `max` non-empty lines a step printed, stdout and stderr in the order they came. */
export class LastLines {
  private lines: string[] = [];
  private readonly max: number;
  constructor(max = 10) {
    this.max = max;
  }
  push(line: string) {
    if (!line.trim()) return;
    this.lines.push(line);
    if (this.lines.length > this.max) this.lines.shift();
  }
  get(): string[] {
    return [...this.lines];
  }
}
