// Git through the API against real servers on loopback (smart HTTP with Basic auth, and sshd), reached from the
// machine as host.kiln.internal. After every case that carries a secret, the machine's filesystem and process
// list, Kiln's data dir and Kiln's log are searched for it.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createServer } from "node:net";
import type { Server, Socket } from "node:net";
import type { AddressInfo } from "node:net";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { commitOnServer, filesContaining, HTTP_USER, makeBareRepo, serverLog, startHttpGitServer, startSshGitServer } from "./git-servers.ts";
import type { HttpGitServer, SshGitServer } from "./git-servers.ts";
import { TEST_RUNTIME } from "../support/paths.ts";

let k: TestKiln;
let http: HttpGitServer;
let ssh: SshGitServer;
let root: string;
let m: any;
/** Passwords the HTTP server accepts: each case adds its own unique one. */
const goodPasswords = new Set<string>();
let httpRepo: string;
let sshRepo: string;

before(async () => {
  root = await mkdtemp(join(tmpdir(), "kiln-git-repos-"));
  httpRepo = await makeBareRepo(root, "app.git");
  sshRepo = await makeBareRepo(root, "ssh-app.git");
  http = await startHttpGitServer(root, (p) => goodPasswords.has(p));
  ssh = await startSshGitServer(`pp-${randomUUID()}`);
  k = await startTestKiln({ env: { KILN_MACHINE_HOST_ACCESS: "1" } });
  m = (await k.call("POST", "/v1/machines", { body: {} })).body;
  assert.ok(m.id, "machine created");
});
after(async () => {
  await k?.close();
  await http?.close();
  await ssh?.close();
  if (root) await rm(root, { recursive: true, force: true });
});

const httpUrl = (repo = "app.git") => `http://host.kiln.internal:${http.port}/${repo}`;
const sshUrl = () => `ssh://root@host.kiln.internal:${ssh.port}${sshRepo}`;
const git = (op: string, body: Record<string, unknown>) => k.call("POST", `/v1/machines/${m.id}/git/${op}`, { body });

function freshPassword() {
  const p = `good-${randomUUID()}`;
  goodPasswords.add(p);
  return p;
}

async function sh(cmd: string, user = "root", stdin?: string) {
  const res = await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd, user, stdin, timeout_s: 120 } });
  assert.equal(res.status, 200, res.text);
  return res.body as { exit_code: number; stdout: string; stderr: string };
}

/** The secret is nowhere: not in the machine's files or processes, not in Kiln's data dir, not in Kiln's log. */
async function assertGone(secret: string) {
  // The pattern goes through stdin, so the search itself never puts the secret in an argv.
  const found = await sh("grep -rlF --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev -f - / 2>/dev/null; true", "root", secret);
  assert.equal(found.stdout.trim(), "", `the secret is in the machine's files: ${found.stdout}`);
  const ps = await sh("ps -eo args");
  assert.ok(!ps.stdout.includes(secret), "the secret is in the machine's process list");
  const env = await sh("cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'");
  assert.ok(!env.stdout.includes(secret), "the secret is in a process environment");
  const scratch = await sh("ls -a /tmp");
  assert.ok(!/kiln-git-/.test(scratch.stdout), `a scratch dir is left: ${scratch.stdout}`);
  assert.deepEqual(await filesContaining(k.dataDir, secret), [], "the secret is in Kiln's data dir");
  assert.ok(!k.logs.join("").includes(secret), "the secret is in Kiln's log");
}

test("clone, status, commit and push over HTTPS with the right credentials; default remote origin", async () => {
  const password = freshPassword();
  const auth = { kind: "https", username: HTTP_USER, password };
  const clone = await git("clone", { url: httpUrl(), path: "/workspace/app", auth });
  assert.equal(clone.status, 200, clone.text);
  assert.equal(clone.body.path, "/workspace/app");
  assert.equal(clone.body.branch, "main");
  assert.match(clone.body.commit, /^[0-9a-f]{40}$/);
  const owner = await sh("stat -c %U /workspace/app/README.md");
  assert.equal(owner.stdout.trim(), "user", "git runs as the machine's user by default");

  await sh("echo hello > /workspace/app/hello.txt && echo more >> /workspace/app/README.md", "user");
  const st = await git("status", { path: "/workspace/app" });
  assert.equal(st.status, 200, st.text);
  assert.equal(st.body.branch, "main");
  assert.equal(st.body.upstream, "origin/main");
  assert.equal(st.body.clean, false);
  const byPath = Object.fromEntries(st.body.files.map((f: any) => [f.path, f.status]));
  assert.deepEqual(byPath, { "README.md": "modified", "hello.txt": "untracked" });

  const added = await git("add", { path: "app" }); // relative: resolves from /workspace like file paths
  assert.equal(added.status, 200, added.text);
  assert.deepEqual(added.body.files.map((f: any) => f.index).sort(), ["A", "M"]);
  const commit = await git("commit", { path: "/workspace/app", message: "add hello\n\nwith a body", author_name: "Ada Agent", author_email: "ada@example.com" });
  assert.equal(commit.status, 200, commit.text);
  assert.match(commit.body.sha, /^[0-9a-f]{40}$/);
  assert.equal(commit.body.author_name, "Ada Agent");
  assert.equal(commit.body.message, "add hello");
  const ahead = await git("status", { path: "/workspace/app" });
  assert.equal(ahead.body.ahead, 1);
  assert.equal(ahead.body.behind, 0);

  const push = await git("push", { path: "/workspace/app", auth });
  assert.equal(push.status, 200, push.text);
  assert.deepEqual(Object.keys(push.body), ["summary"]);
  assert.match(push.body.summary, /main -> main/);
  assert.match(serverLog(httpRepo), new RegExp(`^${commit.body.sha} Ada Agent <ada@example.com> add hello`));
  const config = await sh("cat /workspace/app/.git/config");
  assert.ok(!config.stdout.includes(password) && !config.stdout.includes(HTTP_USER + ":"), "no credential in .git/config");
  await assertGone(password);
});

test("push with a wrong password is 422 git_error auth_failed, and the secret is gone", async () => {
  const wrong = `bad-${randomUUID()}`;
  await sh("cd /workspace/app && echo x >> hello.txt && git add -A && git -c user.name=a -c user.email=a@b commit -qm wrong", "user");
  const before = http.authorized;
  const res = await git("push", { path: "/workspace/app", remote: "origin", auth: { kind: "https", username: HTTP_USER, password: wrong } });
  assert.equal(res.status, 422, res.text);
  assert.equal(res.body.code, "git_error");
  assert.equal(res.body.error_detail.details.reason, "auth_failed");
  assert.equal(typeof res.body.error_detail.details.stderr, "string");
  assert.ok(!res.text.includes(wrong));
  assert.equal(http.authorized, before, "the server never accepted the request");
  await assertGone(wrong);
});

test("push without auth to a server that wants it fails as auth_failed, not a hang", async () => {
  const res = await git("push", { path: "/workspace/app", timeout_s: 30 });
  assert.equal(res.status, 422, res.text);
  assert.equal(res.body.error_detail.details.reason, "auth_failed");
});

test("set_upstream on a new branch records the upstream; branches lists it", async () => {
  const password = freshPassword();
  const auth = { kind: "https", username: HTTP_USER, password };
  const co = await git("checkout", { path: "/workspace/app", branch: "feature/x", create: true });
  assert.equal(co.status, 200, co.text);
  assert.equal(co.body.branch, "feature/x");
  await sh("echo f > /workspace/app/f.txt", "user");
  assert.equal((await git("add", { path: "/workspace/app", files: ["f.txt"] })).status, 200);
  assert.equal((await git("commit", { path: "/workspace/app", message: "feature", author_name: "A", author_email: "a@b.c" })).status, 200);
  const before = await git("status", { path: "/workspace/app" });
  assert.equal(before.body.upstream, null);
  const push = await git("push", { path: "/workspace/app", branch: "feature/x", set_upstream: true, auth });
  assert.equal(push.status, 200, push.text);
  assert.match(push.body.summary, /feature\/x -> feature\/x/);
  const after = await git("status", { path: "/workspace/app" });
  assert.equal(after.body.upstream, "origin/feature/x");
  assert.equal(after.body.ahead, 0);
  const br = await git("branches", { path: "/workspace/app" });
  assert.equal(br.body.current, "feature/x");
  assert.deepEqual(
    br.body.branches.map((b: any) => [b.name, b.upstream]),
    [
      ["feature/x", "origin/feature/x"],
      ["main", "origin/main"],
    ],
  );
  assert.match(serverLog(httpRepo, "feature/x"), /feature/);
  const back = await git("checkout", { path: "/workspace/app", branch: "main" });
  assert.equal(back.body.branch, "main");
  await assertGone(password);
});

test("fetch shows behind, pull brings the other contributor's commit", async () => {
  const password = freshPassword();
  const auth = { kind: "https", username: HTTP_USER, password };
  // main here is one commit ahead (the "wrong" case); align it with the server first.
  assert.equal((await git("push", { path: "/workspace/app", auth })).status, 200);
  const theirs = await commitOnServer(httpRepo, "theirs.txt", "from elsewhere\n");
  const fetch = await git("fetch", { path: "/workspace/app", auth });
  assert.equal(fetch.status, 200, fetch.text);
  const st = await git("status", { path: "/workspace/app" });
  assert.equal(st.body.behind, 1);
  const pull = await git("pull", { path: "/workspace/app", auth });
  assert.equal(pull.status, 200, pull.text);
  assert.equal((await sh("cat /workspace/app/theirs.txt")).stdout, "from elsewhere\n");
  assert.equal((await git("status", { path: "/workspace/app" })).body.commit, theirs);
  await assertGone(password);
});

test("a push the server refuses as non-fast-forward is rejected", async () => {
  const password = freshPassword();
  const auth = { kind: "https", username: HTTP_USER, password };
  await commitOnServer(httpRepo, "race.txt", "they were first\n");
  await sh("cd /workspace/app && echo mine > mine.txt && git add -A && git -c user.name=a -c user.email=a@b commit -qm mine", "user");
  const res = await git("push", { path: "/workspace/app", auth });
  assert.equal(res.status, 422, res.text);
  assert.equal(res.body.error_detail.details.reason, "rejected");
  assert.match(res.body.error_detail.details.stderr, /rejected/);
  await assertGone(password);
});

test("not a repository, unknown remote, unknown repository on the server", async () => {
  const notRepo = await git("status", { path: "/tmp" });
  assert.equal(notRepo.status, 422, notRepo.text);
  assert.equal(notRepo.body.error_detail.details.reason, "not_a_repository");
  const missing = await git("push", { path: "/workspace/nothing-here" });
  assert.equal(missing.body.error_detail.details.reason, "not_a_repository");
  const noRemote = await git("push", { path: "/workspace/app", remote: "upstream" });
  assert.equal(noRemote.status, 422);
  assert.equal(noRemote.body.error_detail.details.reason, "remote_not_found");
  const password = freshPassword();
  const noRepo = await git("clone", { url: httpUrl("nope.git"), path: "/workspace/nope", auth: { kind: "https", username: HTTP_USER, password } });
  assert.equal(noRepo.status, 422, noRepo.text);
  assert.equal(noRepo.body.error_detail.details.reason, "remote_not_found");
});

test("credentials are validated by kind (400) and unsafe clone URLs are refused", async () => {
  const cases: Record<string, unknown>[] = [
    { kind: "https", username: "u" },
    { kind: "https", password: "p" },
    { kind: "ssh" },
    { kind: "ssh", private_key: "k", password: "p" },
    { kind: "ftp", username: "u", password: "p" },
    { kind: "https", username: "u", password: "p", token: "t" },
  ];
  for (const auth of cases) {
    const res = await git("push", { path: "/workspace/app", auth });
    assert.equal(res.status, 400, `${JSON.stringify(auth)} → ${res.text}`);
    assert.equal(res.body.code, "invalid_request");
  }
  for (const url of ["ext::sh -c touch% /tmp/pwned", "-uhoh", `http://u:secret@host.kiln.internal:${http.port}/app.git`]) {
    const res = await git("clone", { url, path: "/workspace/evil" });
    assert.equal(res.status, 400, `${url} → ${res.text}`);
  }
  assert.equal((await git("push", { path: "/workspace/app", branch: "--force" })).status, 400, "a ref may not look like an option");
  assert.equal((await git("push", { path: "/workspace/app", extra: 1 })).status, 400, "unknown fields are refused");
  assert.equal((await sh("ls /tmp/pwned 2>&1; true")).stdout.includes("No such file"), true);
});

test("clone and push over SSH with a key (IdentitiesOnly), and the key is gone afterwards", async () => {
  const auth = { kind: "ssh", private_key: ssh.keys.plain };
  const clone = await git("clone", { url: sshUrl(), path: "/workspace/ssh-app", auth });
  assert.equal(clone.status, 200, clone.text);
  assert.equal(clone.body.branch, "main");
  await sh("echo s > /workspace/ssh-app/s.txt", "user");
  await git("add", { path: "/workspace/ssh-app" });
  const c = await git("commit", { path: "/workspace/ssh-app", message: "over ssh", author_name: "S", author_email: "s@s.s" });
  assert.equal(c.status, 200, c.text);
  const push = await git("push", { path: "/workspace/ssh-app", auth });
  assert.equal(push.status, 200, push.text);
  assert.match(push.body.summary, /main -> main/);
  assert.match(serverLog(sshRepo), new RegExp(`^${c.body.sha}`));
  const known = await sh("ls -a /home/user/.ssh 2>&1; true");
  assert.ok(!known.stdout.includes("known_hosts"), "the accepted host key went with the scratch dir");
  await assertGone(ssh.keys.plain.split("\n")[1]);
});

test("an SSH key with a passphrase: the right one pushes, a wrong one is auth_failed; neither is left behind", async () => {
  await sh("echo p > /workspace/ssh-app/p.txt", "user");
  await git("add", { path: "/workspace/ssh-app" });
  await git("commit", { path: "/workspace/ssh-app", message: "with passphrase", author_name: "S", author_email: "s@s.s" });
  const wrong = `pp-wrong-${randomUUID()}`;
  const bad = await git("push", { path: "/workspace/ssh-app", auth: { kind: "ssh", private_key: ssh.keys.encrypted, passphrase: wrong } });
  assert.equal(bad.status, 422, bad.text);
  assert.equal(bad.body.error_detail.details.reason, "auth_failed");
  const none = await git("push", { path: "/workspace/ssh-app", auth: { kind: "ssh", private_key: ssh.keys.encrypted } });
  assert.equal(none.status, 422, none.text);
  assert.equal(none.body.error_detail.details.reason, "auth_failed");
  const good = await git("push", { path: "/workspace/ssh-app", auth: { kind: "ssh", private_key: ssh.keys.encrypted, passphrase: ssh.keys.passphrase } });
  assert.equal(good.status, 200, good.text);
  assert.match(good.body.summary, /main -> main/);
  await assertGone(wrong);
  await assertGone(ssh.keys.passphrase);
  await assertGone(ssh.keys.encrypted.split("\n")[1]);
});

test("a credential store configured in the machine never receives the credentials", async () => {
  await sh("git config --global credential.helper store", "user");
  await sh("git config --system credential.helper 'cache --timeout=3600'");
  const password = freshPassword();
  const res = await git("fetch", { path: "/workspace/app", auth: { kind: "https", username: HTTP_USER, password } });
  assert.equal(res.status, 200, res.text);
  const stored = await sh("ls -a /home/user; ls -a /home/user/.cache 2>/dev/null; true");
  assert.ok(!stored.stdout.includes(".git-credentials"), stored.stdout);
  assert.ok(!/git-credential-cache/.test((await sh("ps -eo args")).stdout), "no credential cache daemon was started");
  await sh("git config --global --unset credential.helper", "user");
  await sh("git config --system --unset credential.helper");
  await assertGone(password);
});

test("the secret search finds a secret that is there (the sweep can fail)", async () => {
  const planted = `planted-${randomUUID()}`;
  await sh(`echo ${planted} > /workspace/planted.txt`, "user");
  await assert.rejects(assertGone(planted), /machine's files/);
  assert.ok((await filesContaining(k.dataDir, planted)).some((f) => f.endsWith("planted.txt")), "a machine's writes are in the data dir searched");
  await sh("rm /workspace/planted.txt");
});

/** A TCP server that accepts and never answers: a git remote that hangs. */
async function hangingServer(): Promise<{ port: number; close(): Promise<void> }> {
  const sockets = new Set<Socket>();
  const server: Server = createServer((s) => {
    sockets.add(s);
    s.on("error", () => undefined);
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  return {
    port: (server.address() as AddressInfo).port,
    close: () =>
      new Promise((r) => {
        for (const s of sockets) s.destroy();
        server.close(() => r());
      }),
  };
}

test("a push past its timeout is 422 timeout, and the scratch dir and secret are gone", async () => {
  const hang = await hangingServer();
  try {
    const password = freshPassword();
    await sh(`cd /workspace/app && git remote add hang http://host.kiln.internal:${hang.port}/x.git`, "user");
    const started = Date.now();
    const res = await git("push", { path: "/workspace/app", remote: "hang", auth: { kind: "https", username: HTTP_USER, password }, timeout_s: 2 });
    assert.equal(res.status, 422, res.text);
    assert.equal(res.body.error_detail.details.reason, "timeout");
    assert.ok(Date.now() - started < 15_000);
    await assertGone(password);
  } finally {
    await hang.close();
  }
});

test("a client that hangs up cancels its git run: the process and the scratch dir go", async () => {
  const hang = await hangingServer();
  try {
    const password = freshPassword();
    // This test's own hanging server (an earlier test may have pointed `hang` at one that is closed now).
    await sh(`cd /workspace/app && (git remote remove hang 2>/dev/null; git remote add hang http://host.kiln.internal:${hang.port}/x.git)`, "user");
    const controller = new AbortController();
    const pending = request(`${k.url}/v1/machines/${m.id}/git/push`, {
      method: "POST",
      headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" },
      body: JSON.stringify({ path: "/workspace/app", remote: "hang", auth: { kind: "https", username: HTTP_USER, password } }),
      signal: controller.signal,
    }).catch((err: Error) => err);
    // Wait until git is really running (its scratch dir exists), then hang up.
    // Bounded generously: on a loaded 2-core host git can take seconds to get that far.
    for (let i = 0; i < 1200 && !/kiln-git-/.test((await sh("ls -a /tmp")).stdout); i++) await new Promise((r) => setTimeout(r, 25));
    controller.abort();
    assert.ok((await pending) instanceof Error);
    let left = "";
    for (let i = 0; i < 200; i++) {
      left = (await sh("ls -a /tmp; ps -eo args | grep -c '[g]it.*push' || true")).stdout;
      if (!/kiln-git-/.test(left) && /^0$/m.test(left)) break;
      await new Promise((r) => setTimeout(r, 25));
    }
    assert.ok(!/kiln-git-/.test(left) && /^0$/m.test(left), left);
    await assertGone(password);
  } finally {
    await hang.close();
  }
});

// The CLI does not depend on the runtime; the machine side of this is covered on gVisor by the tests above.
test("kiln git clone, commit and push take the password from the environment, never argv", { skip: TEST_RUNTIME === "runsc" && "the CLI runs on runc only" }, async () => {
  const { execFile } = await import("node:child_process");
  const bin = new URL("../../bin/kiln", import.meta.url).pathname;
  const password = freshPassword();
  const cli = (args: string[]) =>
    new Promise<{ code: number | null; stdout: string; stderr: string }>((resolve) =>
      execFile(bin, args, { env: { ...process.env, KILN_URL: k.url, KILN_API_KEY: TEST_KEY, KILN_GIT_PASSWORD: password } }, (err, stdout, stderr) =>
        resolve({ code: err ? ((err as { code?: number }).code ?? 1) : 0, stdout, stderr }),
      ),
    );
  const clone = await cli(["git", "clone", m.id, httpUrl(), "/workspace/cli-app", "--https-user", HTTP_USER]);
  assert.equal(clone.code, 0, clone.stderr);
  assert.equal(clone.stdout, "/workspace/cli-app (main)\n");
  await sh("echo cli > /workspace/cli-app/cli.txt", "user");
  const status = await cli(["git", "status", m.id, "/workspace/cli-app"]);
  assert.match(status.stdout, /^main → origin\/main \(ahead 0, behind 0\)\n  untracked\tcli.txt\n$/);
  const commit = await cli(["git", "commit", m.id, "/workspace/cli-app", "-m", "from the cli", "--author-name", "Cli", "--author-email", "cli@example.com"]);
  assert.match(commit.stdout, /^[0-9a-f]{40} on main\n$/);
  const push = await cli(["git", "push", m.id, "/workspace/cli-app", "--https-user", HTTP_USER]);
  assert.equal(push.code, 0, push.stderr);
  assert.match(push.stdout, /main -> main/);
  assert.match(serverLog(httpRepo), /Cli <cli@example.com> from the cli/);
  await assertGone(password);
});

test("git runs as the user asked for", async () => {
  const st = await git("status", { path: "/workspace/ssh-app", user: "root" });
  // root reading a repository owned by user: git's safe.directory check refuses it, and says so.
  assert.equal(st.status, 422, st.text);
  assert.match(st.body.error_detail.details.stderr, /dubious ownership/);
  assert.equal((await git("status", { path: "/workspace/ssh-app", user: "nobody-here" })).status, 400);
});
