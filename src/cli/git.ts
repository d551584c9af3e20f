// `kiln git clone|status|commit|push|pull`: git in a machine for people. Credentials never come from the command
// line (argv is visible to every process): an HTTPS password from KILN_GIT_PASSWORD, an SSH key from a file.

import type { Command } from "commander";
import { readFileSync } from "node:fs";
import { apiClient, fail } from "./client.ts";

interface AuthOpts {
  httpsUser?: string;
  sshKey?: string;
  as?: string;
}

function asUser(cmd: Command): Command {
  return cmd.option("--as <user>", "machine user to run git as (default: the machine's)");
}

function withAuth(cmd: Command): Command {
  return asUser(
    cmd
      .option("--https-user <name>", "HTTPS username; the password (or token) is read from KILN_GIT_PASSWORD")
      .option("--ssh-key <file>", "SSH private key file; a passphrase is read from KILN_GIT_PASSPHRASE"),
  );
}

function authOf(opts: AuthOpts): Record<string, string> | undefined {
  if (opts.httpsUser) {
    const password = process.env.KILN_GIT_PASSWORD;
    if (!password) fail("--https-user needs the password in KILN_GIT_PASSWORD");
    return { kind: "https", username: opts.httpsUser, password };
  }
  if (opts.sshKey) {
    let key: string;
    try {
      key = readFileSync(opts.sshKey, "utf8");
    } catch (err) {
      fail(`cannot read ${opts.sshKey}: ${(err as NodeJS.ErrnoException).code}`);
    }
    return { kind: "ssh", private_key: key, ...(process.env.KILN_GIT_PASSPHRASE ? { passphrase: process.env.KILN_GIT_PASSPHRASE } : {}) };
  }
  return undefined;
}

const post = <T>(machine: string, op: string, body: Record<string, unknown>) => apiClient().call<T>("POST", `/v1/machines/${machine}/git/${op}`, body);

export function gitCommands(program: Command) {
  const git = program.command("git").description("Git in a machine with per-operation credentials (talks to a running server)");

  withAuth(git.command("clone").description("Clone url into path").argument("<machine>").argument("<url>").argument("<path>").option("-b, --branch <branch>")).action(
    async (machine: string, url: string, path: string, opts: AuthOpts & { branch?: string }) => {
      const r = await post<{ path: string; branch: string | null }>(machine, "clone", { url, path, branch: opts.branch, auth: authOf(opts), user: opts.as });
      process.stdout.write(`${r.path} (${r.branch ?? "detached"})\n`);
    },
  );

  asUser(git.command("status").description("Branch, ahead/behind and changed files").argument("<machine>").argument("<path>").option("--json")).action(
    async (machine: string, path: string, opts: AuthOpts & { json?: boolean }) => {
      const st = await post<{ branch: string | null; upstream: string | null; ahead: number; behind: number; files: { path: string; status: string }[] }>(machine, "status", { path, user: opts.as });
      if (opts.json) return void process.stdout.write(JSON.stringify(st, null, 2) + "\n");
      process.stdout.write(`${st.branch ?? "(detached)"}${st.upstream ? ` → ${st.upstream} (ahead ${st.ahead}, behind ${st.behind})` : ""}\n`);
      for (const f of st.files) process.stdout.write(`  ${f.status}\t${f.path}\n`);
    },
  );

  asUser(
    git
      .command("commit")
      .description("Stage every change and commit it")
      .argument("<machine>")
      .argument("<path>")
      .requiredOption("-m, --message <message>")
      .option("--author-name <name>")
      .option("--author-email <email>"),
  ).action(async (machine: string, path: string, opts: AuthOpts & { message: string; authorName?: string; authorEmail?: string }) => {
    await post(machine, "add", { path, user: opts.as });
    const c = await post<{ sha: string; branch: string | null }>(machine, "commit", { path, message: opts.message, author_name: opts.authorName, author_email: opts.authorEmail, user: opts.as });
    process.stdout.write(`${c.sha} on ${c.branch ?? "(detached)"}\n`);
  });

  withAuth(
    git.command("push").description("Push to a remote").argument("<machine>").argument("<path>").option("--remote <remote>").option("--branch <branch>").option("-u, --set-upstream"),
  ).action(async (machine: string, path: string, opts: AuthOpts & { remote?: string; branch?: string; setUpstream?: boolean }) => {
    const r = await post<{ summary: string }>(machine, "push", { path, remote: opts.remote, branch: opts.branch, set_upstream: opts.setUpstream, auth: authOf(opts), user: opts.as });
    process.stdout.write(r.summary + "\n");
  });

  withAuth(git.command("pull").description("Pull from the upstream (or --remote/--branch)").argument("<machine>").argument("<path>").option("--remote <remote>").option("--branch <branch>")).action(
    async (machine: string, path: string, opts: AuthOpts & { remote?: string; branch?: string }) => {
      const r = await post<{ summary: string }>(machine, "pull", { path, remote: opts.remote, branch: opts.branch, auth: authOf(opts), user: opts.as });
      process.stdout.write(r.summary + "\n");
    },
  );
}
