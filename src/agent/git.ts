// Git inside the machine with per-operation credentials: the secret files (HTTPS password, SSH key, passphrase) live
// in a 0700 directory on a memory filesystem (never on the machine's disk, so never in its disk image), the askpass
// helper that reads them in another on /tmp (it holds only their path); both are removed however the run ends.

import { spawn } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { chmod, chown, lchown, mkdtemp, rm, statfs, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { AgentFailure } from "./errors.ts";
import { processEnv, resolveUser, workingDir } from "./process.ts";
import { killGroup } from "./process-tree.ts";
import type { GitAuth, GitRunRequest, GitRunResult } from "./protocol.ts";
import { SCRATCH_PREFIX, SECRETS_ROOT } from "./git-scratch.ts";

const OUTPUT_CAP = 4 * 1024 * 1024;
const TMPFS_MAGIC = 0x01021994;

/**
 * The askpass helper answers only ssh's "Enter passphrase for key …" (the passphrase never leaves the machine). It
 * prints a file of the secrets directory, so no secret is ever in an argv, a URL, an environment or a file on disk
 * (the helper itself must be on an exec-able filesystem, which the memory one is not). It never answers git's
 * "Username for …"/"Password for …": those prompts name whatever host git is talking to, a redirect's target too.
 */
const askpass = (secrets: string) => `#!/bin/sh
d='${secrets}'
case "$1" in
  *assphrase*) [ -f "$d/passphrase" ] && exec cat "$d/passphrase" ;;
esac
exit 1
`;

/**
 * HTTPS credentials come from a credential helper that git consults only for the remote's own origin
 * (`credential.<scheme>://<host>[:port].helper`, matched by git's own URL normalisation): a remote that redirects to
 * another host, or a second remote, is asked about with no helper and the askpass above, which refuses.
 */
const credentialHelper = (secrets: string) => `#!/bin/sh
[ "$1" = get ] && exec cat '${secrets}/credential'
exit 0
`;

/** `scheme://host[:port]` of each http(s) URL the credentials are meant for (the remote's own URLs); others are dropped. */
export function credentialOrigins(urls: string[] | undefined): string[] {
  const out = new Set<string>();
  for (const u of urls ?? []) {
    try {
      const url = new URL(u);
      if ((url.protocol === "https:" || url.protocol === "http:") && url.host && !url.username && !url.password) out.add(`${url.protocol}//${url.host}`);
    } catch {
      // a path, an scp-like ssh address: no HTTPS origin
    }
  }
  return [...out];
}

/**
 * Variables of the machine's environment that would make git write what it sends (traces of HTTP headers, of the
 * packet exchange) or load configuration past the agent's `-c` options: dropped from a run that carries credentials.
 */
const UNSAFE_WITH_CREDENTIALS = /^(GIT_TRACE.*|GIT_CURL_VERBOSE|GIT_CONFIG_PARAMETERS|GIT_CONFIG_COUNT|GIT_CONFIG_KEY_\d+|GIT_CONFIG_VALUE_\d+|GIT_SSH|GIT_SSH_VARIANT|GIT_ASKPASS|SSH_ASKPASS.*|SSH_AUTH_SOCK|GIT_TERMINAL_PROMPT)$/;

/** Every credential string (and each line of a key) that must not appear in anything returned or logged. */
export function secretsOf(auth: GitAuth | undefined): string[] {
  if (!auth) return [];
  const out: string[] = [];
  for (const v of [auth.password, auth.passphrase, auth.username]) if (v && v.length >= 3) out.push(v);
  if (auth.private_key) {
    out.push(auth.private_key.trim());
    for (const line of auth.private_key.split(/\r?\n/)) if (line.trim().length >= 8) out.push(line.trim());
  }
  return out.sort((a, b) => b.length - a.length);
}

/** Removes credentials from git's output: the given secrets, and any userinfo of a URL (https://user:pass@host). */
export function scrub(text: string, secrets: string[]): string {
  let out = text;
  for (const s of secrets) out = out.split(s).join("[redacted]");
  return out.replace(/([a-z][a-z0-9+.-]*:\/\/)[^/@\s]+@/gi, "$1[redacted]@");
}

export function checkAuth(auth: unknown): GitAuth | undefined {
  if (auth === undefined || auth === null) return undefined;
  const a = auth as Record<string, unknown>;
  const str = (k: string) => a[k] === undefined || typeof a[k] === "string";
  if (typeof a !== "object" || !["kind", "username", "password", "private_key", "passphrase"].every(str)) throw new AgentFailure("invalid_request", "auth fields must be strings");
  if (a.kind === "https" && a.username && a.password) {
    // git's credential protocol is one key=value per line: a line break would add keys of the caller's choosing.
    if (/[\r\n\0]/.test(`${a.username}${a.password}`)) throw new AgentFailure("invalid_request", "auth username and password must not hold line breaks or NUL");
    return a as unknown as GitAuth;
  }
  if (a.kind === "ssh" && a.private_key) return a as unknown as GitAuth;
  throw new AgentFailure("invalid_request", "auth must be {kind:'https', username, password} or {kind:'ssh', private_key, passphrase?}");
}

/** Writes the scratch directories for one operation and returns the environment that makes git and ssh use them. */
async function prepareScratch(auth: GitAuth, origins: string[], uid: number, gid: number): Promise<{ dirs: string[]; env: Record<string, string>; config: string[] }> {
  const fs = await statfs(SECRETS_ROOT).catch(() => undefined);
  if (!fs || Number(fs.type) !== TMPFS_MAGIC) throw new AgentFailure("internal", `${SECRETS_ROOT} is not a memory filesystem in this machine: credentials are never written to its disk`);
  // Filled while they are still root's (0700), handed to the user only when complete: the user can never swap a
  // file for a symlink between its write and its chown (lchown, too, never follows one).
  const secrets = await mkdtemp(join(SECRETS_ROOT, SCRATCH_PREFIX));
  const dirs = [secrets];
  const files: string[] = [];
  try {
    const helperDir = await mkdtemp(join(tmpdir(), SCRATCH_PREFIX));
    dirs.push(helperDir);
    for (const d of dirs) await chmod(d, 0o700);
    const put = async (dir: string, name: string, text: string, mode: number) => {
      // Created with its final mode: there is no moment at which it is readable by others.
      await writeFile(join(dir, name), text, { mode, flag: "wx" });
      files.push(join(dir, name));
    };
    await put(helperDir, "askpass", askpass(secrets), 0o700);
    const helper = join(helperDir, "askpass");
    const env: Record<string, string> = { GIT_ASKPASS: helper, SSH_ASKPASS: helper, SSH_ASKPASS_REQUIRE: "force", GIT_TRACE_REDACT: "1" };
    const dir = secrets;
    const config: string[] = [];
    if (auth.kind === "https") {
      await put(dir, "credential", `username=${auth.username!}\npassword=${auth.password!}\n`, 0o600);
      await put(helperDir, "credential-helper", credentialHelper(secrets), 0o700);
      for (const origin of origins) config.push("-c", `credential.${origin}.helper=${join(helperDir, "credential-helper")}`);
    } else {
      const key = auth.private_key!.endsWith("\n") ? auth.private_key! : `${auth.private_key}\n`;
      await put(dir, "id", key, 0o600);
      if (auth.passphrase !== undefined) await put(dir, "passphrase", auth.passphrase, 0o600);
      await put(dir, "known_hosts", "", 0o600);
      // Known hosts: the user's own ~/.ssh/known_hosts pins what it lists (a mismatch fails); a host it does not
      // list is accepted into this directory's file, which goes with the operation (see docs/git-and-kernels.md).
      env.GIT_SSH_COMMAND = [
        "ssh",
        `-i ${dir}/id`,
        "-o IdentitiesOnly=yes",
        "-o IdentityAgent=none",
        "-o PasswordAuthentication=no",
        "-o KbdInteractiveAuthentication=no",
        "-o StrictHostKeyChecking=accept-new",
        `-o 'UserKnownHostsFile=${dir}/known_hosts ~/.ssh/known_hosts'`,
        "-o ConnectTimeout=20",
        "-o LogLevel=ERROR", // no "Permanently added ... to the list of known hosts" in every summary
      ].join(" ");
    }
    for (const f of files) await lchown(f, uid, gid);
    for (const d of dirs) await chown(d, uid, gid);
    return { dirs, env, config };
  } catch (err) {
    for (const d of dirs) await rm(d, { recursive: true, force: true });
    throw err;
  }
}

/**
 * Runs `git <args>` as `user` in `cwd` with the credentials of `auth`. `signal` (the caller went away) and
 * `timeout_ms` both end the whole process group; the scratch directory is removed in every case.
 */
export async function runGit(req: GitRunRequest, signal: AbortSignal): Promise<GitRunResult> {
  if (!Array.isArray(req.args) || !req.args.every((a) => typeof a === "string" && !a.includes("\0"))) throw new AgentFailure("invalid_request", "args must be strings");
  const auth = checkAuth(req.auth);
  const user = resolveUser(req.user);
  const cwd = workingDir(req.cwd, user);
  const secrets = secretsOf(auth);
  const started = performance.now();
  const scratch = auth ? await prepareScratch(auth, credentialOrigins(req.credential_urls), user.uid, user.gid) : undefined;
  try {
    const base = processEnv(user, undefined);
    if (scratch) for (const name of Object.keys(base)) if (UNSAFE_WITH_CREDENTIALS.test(name)) delete base[name];
    const env = {
      ...base,
      GIT_TERMINAL_PROMPT: "0",
      // No askpass at all without credentials: a prompt must fail, not hang or reach a desktop helper.
      ...(scratch ? scratch.env : { GIT_ASKPASS: "/bin/false", SSH_ASKPASS: "/bin/false", SSH_ASKPASS_REQUIRE: "never", GIT_SSH_COMMAND: "ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new" }),
      ...req.envs,
    };
    // protocol.ext runs arbitrary commands; an empty credential.helper resets the helper list from every config
    // file, so no store or cache ever sees the credentials. GIT_ASKPASS wins over any core.askPass.
    // credential.useHttpPath=false keeps the helper's context to scheme+host(+port), the origin it is scoped to.
    const argv = ["-c", "protocol.ext.allow=never", "-c", "credential.helper=", "-c", "credential.useHttpPath=false", ...(scratch?.config ?? []), ...req.args];
    const result = await new Promise<GitRunResult>((resolve, reject) => {
      let child: ChildProcess;
      try {
        child = spawn("git", argv, { cwd, env, uid: user.uid, gid: user.gid, detached: true, stdio: [req.stdin === undefined ? "ignore" : "pipe", "pipe", "pipe"] });
      } catch (err) {
        return reject(err);
      }
      const out: Buffer[] = [];
      const errs: Buffer[] = [];
      let outLen = 0;
      let errLen = 0;
      child.stdout!.on("data", (b: Buffer) => {
        if (outLen < OUTPUT_CAP) out.push(b);
        outLen += b.length;
      });
      child.stderr!.on("data", (b: Buffer) => {
        if (errLen < OUTPUT_CAP) errs.push(b);
        errLen += b.length;
      });
      if (req.stdin !== undefined) {
        child.stdin!.on("error", () => undefined);
        child.stdin!.end(req.stdin);
      }
      let ended: "timeout" | "cancelled" | undefined;
      const stop = (why: "timeout" | "cancelled") => {
        ended ??= why;
        killGroup(child);
      };
      const timer = setTimeout(() => stop("timeout"), req.timeout_ms ?? 120_000);
      const onAbort = () => stop("cancelled");
      signal.addEventListener("abort", onAbort);
      child.on("error", (e: NodeJS.ErrnoException) => {
        clearTimeout(timer);
        signal.removeEventListener("abort", onAbort);
        reject(e.code === "ENOENT" ? new AgentFailure("invalid_request", "git is not installed in this machine") : new AgentFailure("internal", `spawn git failed: ${e.code ?? e.message}`));
      });
      child.on("close", (code, sig) => {
        clearTimeout(timer);
        signal.removeEventListener("abort", onAbort);
        // Anything git left running in its group (an ssh, a remote helper) goes too.
        killGroup(child);
        resolve({
          exit_code: code,
          signal: sig ?? null,
          stdout: scrub(Buffer.concat(out).toString("utf8"), secrets),
          stderr: scrub(Buffer.concat(errs).toString("utf8"), secrets),
          timed_out: ended === "timeout",
          cancelled: ended === "cancelled",
          duration_ms: Math.round((performance.now() - started) * 100) / 100,
        });
      });
    });
    return result;
  } finally {
    if (scratch) for (const d of scratch.dirs) await rm(d, { recursive: true, force: true });
  }
}

/** POST /git/run (see protocol.ts); a request that closes before the answer cancels the run. */
export async function handleGitRun(req: import("node:http").IncomingMessage, res: import("node:http").ServerResponse, body: Record<string, any>): Promise<GitRunResult> {
  const abort = new AbortController();
  res.on("close", () => {
    if (!res.writableFinished) abort.abort();
  });
  req.on("aborted", () => abort.abort());
  return runGit(body as GitRunRequest, abort.signal);
}
