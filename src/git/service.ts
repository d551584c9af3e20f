// Git in a running machine: each operation becomes one git argv (user-supplied refs after --end-of-options) run
// by the guest agent with per-operation credentials; git's failures become 422 git_error with a reason.

import { KilnError } from "../errors.ts";
import type { GitAuth, GitRunResult } from "../agent/protocol.ts";
import type { MachineService } from "../machines/service.ts";
import { machineTarget } from "../machines/target.ts";
import { viaAgent } from "../machines/agent-errors.ts";

export const GIT_AUTH_KINDS = ["https", "ssh"] as const;
/** DESIGN.md §4's reasons, plus `failed` for a git error that is none of them (a merge conflict, nothing to commit). */
export const GIT_FAILURE_REASONS = ["auth_failed", "rejected", "not_a_repository", "remote_not_found", "network", "timeout", "failed"] as const;
export type GitFailureReason = (typeof GIT_FAILURE_REASONS)[number];

export const GIT_DEFAULT_TIMEOUT_S = 120;
export const GIT_DEFAULT_REMOTE = "origin";

interface Common {
  path: string;
  user?: string;
  timeout_s?: number;
}
interface WithAuth {
  auth?: GitAuth;
}

/** Which reason a failed git run is, from its (scrubbed) stderr. Order matters: the most specific first. */
export function classifyGitFailure(stderr: string, timedOut: boolean): GitFailureReason {
  if (timedOut) return "timeout";
  const s = stderr;
  if (/not a git repository|cannot change to '.*': No such file or directory/i.test(s)) return "not_a_repository";
  if (
    /Authentication failed|Permission denied \((publickey|password)|could not read (Username|Password)|terminal prompts disabled|Invalid username or password|HTTP Basic: Access denied|incorrect passphrase|bad passphrase|error: 403|The requested URL returned error: 40[13]|Load key .*: (incorrect passphrase|invalid format|error in libcrypto)/i.test(
      s,
    )
  )
    return "auth_failed";
  if (/\[rejected\]|\[remote rejected\]|non-fast-forward|Updates were rejected|failed to push some refs|pre-receive hook declined/i.test(s)) return "rejected";
  if (/does not appear to be a git repository|repository '.*' not found|Repository not found|No such remote|couldn't find remote ref|The requested URL returned error: 404|does not exist|not found\s*$/im.test(s)) return "remote_not_found";
  if (/Could not resolve host|Connection refused|Connection timed out|Failed to connect|Network is unreachable|No route to host|ssh: connect to host|Could not read from remote repository|unable to access|Connection reset|early EOF|RPC failed|Host key verification failed/i.test(s))
    return "network";
  return "failed";
}

export interface GitStatusFile {
  path: string;
  /** Index (staged) state letter: M, A, D, R, C, U or "." for unchanged; "?" untracked. */
  index: string;
  /** Work-tree state letter, same letters. */
  worktree: string;
  /** modified, added, deleted, renamed, copied, conflicted, untracked, ignored, type_changed */
  status: string;
  original_path?: string;
}

export interface GitStatus {
  branch: string | null;
  detached: boolean;
  commit: string | null;
  upstream: string | null;
  ahead: number;
  behind: number;
  clean: boolean;
  files: GitStatusFile[];
}

const LETTER: Record<string, string> = { M: "modified", A: "added", D: "deleted", R: "renamed", C: "copied", U: "conflicted", T: "type_changed" };

function statusWord(xy: string): string {
  if (xy.includes("U") || xy === "AA" || xy === "DD") return "conflicted";
  const letter = xy[0] !== "." ? xy[0] : xy[1];
  return LETTER[letter] ?? "modified";
}

/** Parses `git status --porcelain=v2 --branch -z`. */
export function parseStatus(out: string): GitStatus {
  const st: GitStatus = { branch: null, detached: false, commit: null, upstream: null, ahead: 0, behind: 0, clean: true, files: [] };
  const parts = out.split("\0");
  for (let i = 0; i < parts.length; i++) {
    const rec = parts[i];
    if (!rec) continue;
    if (rec.startsWith("# ")) {
      const [, key, ...rest] = rec.split(" ");
      const val = rest.join(" ");
      if (key === "branch.oid") st.commit = val === "(initial)" ? null : val;
      else if (key === "branch.head") {
        st.detached = val === "(detached)";
        st.branch = st.detached ? null : val;
      } else if (key === "branch.upstream") st.upstream = val;
      else if (key === "branch.ab") {
        const m = /^\+(\d+) -(\d+)$/.exec(val);
        if (m) [st.ahead, st.behind] = [Number(m[1]), Number(m[2])];
      }
      continue;
    }
    const kind = rec[0];
    if (kind === "1") {
      const f = rec.split(" ");
      const xy = f[1];
      st.files.push({ path: f.slice(8).join(" "), index: xy[0], worktree: xy[1], status: statusWord(xy) });
    } else if (kind === "2") {
      const f = rec.split(" ");
      const xy = f[1];
      st.files.push({ path: f.slice(9).join(" "), index: xy[0], worktree: xy[1], status: statusWord(xy), original_path: parts[++i] });
    } else if (kind === "u") {
      const f = rec.split(" ");
      st.files.push({ path: f.slice(10).join(" "), index: f[1][0], worktree: f[1][1], status: "conflicted" });
    } else if (kind === "?") st.files.push({ path: rec.slice(2), index: "?", worktree: "?", status: "untracked" });
  }
  st.clean = st.files.length === 0;
  return st;
}

/** Schemes whose user part is a credential (a token as the user name is common), so no user part is allowed. */
const CREDENTIAL_USER_SCHEMES = new Set(["http", "https", "ftp", "ftps"]);

/**
 * A URL git may talk to, as a clone `url` or a `remote` given as an address: no `<transport>::` helpers (ext:: runs
 * commands) and no credentials in it — no password in any scheme, no user part at all over HTTP(S) — because git
 * writes remote addresses into .git/config (clone's origin, push --set-upstream's branch remote) and FETCH_HEAD.
 * An ssh login name (`ssh://git@host/…`, `git@host:repo`) is not a credential and passes.
 */
export function checkRemoteUrl(value: string, field: "url" | "remote"): void {
  if (value.startsWith("-")) throw new KilnError("invalid_request", `${field} must not start with '-'`);
  if (/[\x00-\x1f\x7f]/.test(value)) throw new KilnError("invalid_request", `${field} must not hold control characters`);
  if (/^[A-Za-z][A-Za-z0-9+.-]*::/.test(value)) throw new KilnError("invalid_request", `${field} must not name a git remote helper (<transport>::<address>)`);
  const url = /^([A-Za-z][A-Za-z0-9+.-]*):\/\/([^/?#]*)/.exec(value);
  if (!url) return; // a remote name, a path, or scp-like user@host:path (ssh, whose user part is a login name)
  const authority = url[2];
  const at = authority.lastIndexOf("@");
  if (at < 0) return;
  const userinfo = authority.slice(0, at);
  if (userinfo.includes(":") || CREDENTIAL_USER_SCHEMES.has(url[1].toLowerCase())) {
    throw new KilnError("invalid_request", `${field} must not carry credentials (user:password@ or a token as the user): pass them in auth, which is never written to the repository or the machine`);
  }
}

/** A clone URL git may fetch from (see checkRemoteUrl). */
export function checkCloneUrl(url: string): void {
  checkRemoteUrl(url, "url");
}

/** SPEC.md's credentials object by kind: https needs username and password, ssh needs private_key. */
export function checkAuth(auth: GitAuth | undefined): void {
  if (!auth) return;
  if (auth.kind === "https") {
    if (!auth.username || !auth.password) throw new KilnError("invalid_request", "auth of kind https needs username and password");
    if (/[\r\n\0]/.test(auth.username + auth.password)) throw new KilnError("invalid_request", "auth username and password must not hold line breaks or NUL");
    if (auth.private_key !== undefined || auth.passphrase !== undefined) throw new KilnError("invalid_request", "private_key and passphrase belong to auth of kind ssh");
  } else if (auth.kind === "ssh") {
    if (!auth.private_key) throw new KilnError("invalid_request", "auth of kind ssh needs private_key");
    if (auth.password !== undefined) throw new KilnError("invalid_request", "password belongs to auth of kind https");
  } else throw new KilnError("invalid_request", "auth.kind must be https or ssh");
}

function firstLine(s: string) {
  return s.trim().split("\n")[0] ?? "";
}

export interface GitService {
  push(id: string, input: Common & WithAuth & { remote?: string; branch?: string; set_upstream?: boolean }, signal?: AbortSignal): Promise<{ summary: string }>;
  clone(id: string, input: Common & WithAuth & { url: string; branch?: string; depth?: number }, signal?: AbortSignal): Promise<{
    path: string;
    branch: string | null;
    commit: string | null;
    summary: string;
  }>;
  pull(id: string, input: Common & WithAuth & { remote?: string; branch?: string; rebase?: boolean }, signal?: AbortSignal): Promise<{ summary: string }>;
  fetch(id: string, input: Common & WithAuth & { remote?: string; prune?: boolean }, signal?: AbortSignal): Promise<{ summary: string }>;
  status(id: string, input: Common): Promise<GitStatus>;
  add(id: string, input: Common & { files?: string[] }): Promise<GitStatus>;
  commit(id: string, input: Common & { message: string; author_name?: string; author_email?: string; allow_empty?: boolean }): Promise<{
    sha: string;
    branch: string | null;
    author_name: string;
    author_email: string;
    message: string;
  }>;
  branches(id: string, input: Common): Promise<{
    current: string | null;
    branches: { name: string; current: boolean; commit: string; upstream: string | null }[];
  }>;
  checkout(id: string, input: Common & { branch: string; create?: boolean }): Promise<{ branch: string | null; commit: string | null; detached: boolean }>;
}

export function createGitService(machines: MachineService): GitService {
  /** The machine, its agent, the repository path resolved like file paths, and who runs git. */
  const target = (id: string, path: string, user: string | undefined) => machineTarget(machines, id, path, user);

  /** Runs `git -C <repo> <args>`; a failed run becomes git_error with its reason and git's scrubbed stderr. */
  async function git(id: string, input: Common & WithAuth, args: string[], opts: { repo?: boolean; envs?: Record<string, string>; stdin?: string; signal?: AbortSignal; credentialUrls?: string[] } = {}) {
    checkAuth(input.auth);
    const t = await target(id, input.path, input.user);
    const timeoutS = input.timeout_s ?? GIT_DEFAULT_TIMEOUT_S;
    const argv = opts.repo === false ? args : ["-C", t.path, ...args];
    const result = await viaAgent(() =>
      t.agent.gitRun({ args: argv, cwd: "/", user: t.user, auth: input.auth, credential_urls: opts.credentialUrls, envs: opts.envs, stdin: opts.stdin, timeout_ms: timeoutS * 1000 }, opts.signal),
    );
    if (result.exit_code !== 0) throw gitFailure(result, timeoutS);
    return { ...result, path: t.path };
  }

  function gitFailure(r: GitRunResult, timeoutS: number): KilnError {
    const reason = classifyGitFailure(r.stderr, r.timed_out);
    const stderr = r.stderr.trim().slice(-8000);
    const message = reason === "timeout" ? `git did not finish within ${timeoutS} s and was stopped` : `git failed (${reason}): ${firstLine(stderr.split("\n").filter((l) => /fatal|error|rejected|denied/i.test(l)).join("\n") || stderr) || `exit ${r.exit_code}`}`;
    return new KilnError("git_error", message, {
      detail: { code: "git_error", message, retryable: reason === "network" || reason === "timeout", details: { reason, stderr, exit_code: r.exit_code } },
    });
  }

  /**
   * The URLs an HTTPS password may go to: the remote's own (a URL as given; a remote name or the default remote as
   * git resolves it, insteadOf included, and its push URLs for a push). The agent offers the password to their
   * scheme+host(+port) only, so a remote that redirects elsewhere never receives it. The lookups are local.
   */
  async function remoteUrls(id: string, input: Common & WithAuth, remote: string | undefined, push: boolean): Promise<string[] | undefined> {
    if (input.auth?.kind !== "https") return undefined;
    if (remote !== undefined && /^[A-Za-z][A-Za-z0-9+.-]*:\/\//.test(remote)) return [remote];
    const local = { path: input.path, user: input.user, timeout_s: input.timeout_s };
    const lines = async (args: string[]) => ((await git(id, local, args).catch(() => undefined))?.stdout ?? "").split("\n").map((l) => l.trim()).filter(Boolean);
    const urls = await lines(["ls-remote", "--get-url", ...(remote !== undefined ? ["--end-of-options", remote] : [])]);
    if (push) urls.push(...(await lines(["remote", "get-url", "--push", "--all", "--end-of-options", remote ?? GIT_DEFAULT_REMOTE])));
    return urls;
  }

  const summaryOf = (r: GitRunResult) => [r.stderr, r.stdout].map((s) => s.trim()).filter(Boolean).join("\n");

  async function status(id: string, input: Common) {
    const r = await git(id, input, ["status", "--porcelain=v2", "--branch", "-z", "--untracked-files=all"]);
    return parseStatus(r.stdout);
  }

  return {
    async push(id: string, input: Common & WithAuth & { remote?: string; branch?: string; set_upstream?: boolean }, signal?: AbortSignal) {
      // Without a branch: the current one by name (so git's summary says `main -> main` and -u has a branch to track).
      // The lookup is local: it gets no credentials.
      checkAuth(input.auth);
      if (input.remote !== undefined) checkRemoteUrl(input.remote, "remote");
      const local = { path: input.path, user: input.user, timeout_s: input.timeout_s };
      const branch = input.branch ?? (await git(id, local, ["symbolic-ref", "--quiet", "--short", "HEAD"]).catch(() => undefined))?.stdout.trim();
      const args = ["push", ...(input.set_upstream ? ["--set-upstream"] : []), "--end-of-options", input.remote ?? GIT_DEFAULT_REMOTE, branch || "HEAD"];
      const r = await git(id, input, args, { signal, credentialUrls: await remoteUrls(id, input, input.remote ?? GIT_DEFAULT_REMOTE, true) });
      return { summary: summaryOf(r) };
    },

    async clone(id: string, input: Common & WithAuth & { url: string; branch?: string; depth?: number }, signal?: AbortSignal) {
      checkCloneUrl(input.url);
      checkAuth(input.auth);
      const t = await target(id, input.path, input.user);
      const args = ["clone", ...(input.branch ? [`--branch=${input.branch}`] : []), ...(input.depth ? [`--depth=${input.depth}`] : []), "--end-of-options", input.url, t.path];
      const r = await git(id, { ...input, path: t.path }, args, { repo: false, signal, credentialUrls: [input.url] });
      const st = await status(id, { path: t.path, user: input.user });
      return { path: t.path, branch: st.branch, commit: st.commit, summary: summaryOf(r) };
    },

    async pull(id: string, input: Common & WithAuth & { remote?: string; branch?: string; rebase?: boolean }, signal?: AbortSignal) {
      if (input.remote !== undefined) checkRemoteUrl(input.remote, "remote");
      const target = input.remote !== undefined || input.branch !== undefined ? ["--end-of-options", input.remote ?? GIT_DEFAULT_REMOTE, ...(input.branch ? [input.branch] : [])] : [];
      const r = await git(id, input, ["pull", "--no-edit", input.rebase ? "--rebase" : "--no-rebase", ...target], { signal, credentialUrls: await remoteUrls(id, input, input.remote, false) });
      return { summary: summaryOf(r) };
    },

    async fetch(id: string, input: Common & WithAuth & { remote?: string; prune?: boolean }, signal?: AbortSignal) {
      if (input.remote !== undefined) checkRemoteUrl(input.remote, "remote");
      const r = await git(id, input, ["fetch", ...(input.prune ? ["--prune"] : []), "--end-of-options", input.remote ?? GIT_DEFAULT_REMOTE], { signal, credentialUrls: await remoteUrls(id, input, input.remote ?? GIT_DEFAULT_REMOTE, false) });
      return { summary: summaryOf(r) || "Already up to date" };
    },

    status,

    async add(id: string, input: Common & { files?: string[] }) {
      const args = input.files?.length ? ["add", "--end-of-options", ...input.files] : ["add", "--all"];
      await git(id, input, args);
      return status(id, input);
    },

    async commit(id: string, input: Common & { message: string; author_name?: string; author_email?: string; allow_empty?: boolean }) {
      const envs: Record<string, string> = {};
      if (input.author_name) envs.GIT_AUTHOR_NAME = envs.GIT_COMMITTER_NAME = input.author_name;
      if (input.author_email) envs.GIT_AUTHOR_EMAIL = envs.GIT_COMMITTER_EMAIL = input.author_email;
      // The message goes through stdin: any text, never mistaken for an option.
      await git(id, input, ["commit", ...(input.allow_empty ? ["--allow-empty"] : []), "--file=-", "--cleanup=strip"], { envs, stdin: input.message }).catch((err: unknown) => {
        const details = err instanceof KilnError ? (err.detail?.details as { stderr?: string } | undefined) : undefined;
        if (details?.stderr && /Please tell me who you are|unable to auto-detect email/i.test(details.stderr)) {
          const message = "git has no author identity in this machine: pass author_name and author_email";
          throw new KilnError("git_error", message, { detail: { ...(err as KilnError).detail, message } });
        }
        throw err;
      });
      const head = await git(id, input, ["log", "-1", "--format=%H%x00%an%x00%ae%x00%s"]);
      const [sha, author_name, author_email, subject] = head.stdout.trim().split("\0");
      const branch = (await status(id, input)).branch;
      return { sha, branch, author_name, author_email, message: subject };
    },

    async branches(id: string, input: Common) {
      const r = await git(id, input, ["for-each-ref", "--format=%(HEAD)%00%(refname:short)%00%(objectname)%00%(upstream:short)", "refs/heads"]);
      const branches = r.stdout
        .split("\n")
        .filter(Boolean)
        .map((line) => {
          const [head, name, sha, upstream] = line.split("\0");
          return { name, current: head === "*", commit: sha, upstream: upstream || null };
        });
      return { current: branches.find((b) => b.current)?.name ?? null, branches };
    },

    async checkout(id: string, input: Common & { branch: string; create?: boolean }) {
      // `switch` (not `checkout`, whose --end-of-options miscounts refs in git 2.39); a new name is glued to its option.
      await git(id, input, input.create ? ["switch", `--create=${input.branch}`] : ["switch", "--end-of-options", input.branch]);
      const st = await status(id, input);
      return { branch: st.branch, commit: st.commit, detached: st.detached };
    },
  };
}
