// The pure parts of git and kernels: failure reasons from git's stderr, porcelain v2 status parsing, clone-URL
// refusal, credential scrubbing, and how a JavaScript cell with top-level await is compiled.

import { test } from "node:test";
import assert from "node:assert/strict";
import { runInNewContext } from "node:vm";
import { checkAuth, checkCloneUrl, classifyGitFailure, parseStatus } from "../../src/git/service.ts";
import { scrub, secretsOf } from "../../src/agent/git.ts";
import { compileCell } from "../../src/agent/kernels/js-cell.ts";
import { KilnError } from "../../src/errors.ts";

test("git failure reasons come from git's own words", () => {
  const cases: [string, string][] = [
    ["fatal: not a git repository (or any of the parent directories): .git", "not_a_repository"],
    ["fatal: cannot change to '/x': No such file or directory", "not_a_repository"],
    ["remote: unauthorized\nfatal: Authentication failed for 'http://h/app.git/'", "auth_failed"],
    ["fatal: could not read Username for 'http://h': terminal prompts disabled", "auth_failed"],
    ["git@h: Permission denied (publickey).\nfatal: Could not read from remote repository.", "auth_failed"],
    [" ! [rejected]        main -> main (fetch first)\nerror: failed to push some refs to 'h'", "rejected"],
    [" ! [remote rejected] main -> main (pre-receive hook declined)", "rejected"],
    ["fatal: 'upstream' does not appear to be a git repository\nfatal: Could not read from remote repository.", "remote_not_found"],
    ["fatal: repository 'http://h/nope.git/' not found", "remote_not_found"],
    ["fatal: unable to access 'http://h/': Could not resolve host: h", "network"],
    ["ssh: connect to host h port 22: Connection refused\nfatal: Could not read from remote repository.", "network"],
    ["error: Your local changes to the following files would be overwritten by merge", "failed"],
  ];
  for (const [stderr, reason] of cases) assert.equal(classifyGitFailure(stderr, false), reason, stderr);
  assert.equal(classifyGitFailure("anything", true), "timeout");
});

test("status --porcelain=v2 -z parses into branch, upstream, ahead/behind and files", () => {
  const out = [
    "# branch.oid 1111111111111111111111111111111111111111",
    "# branch.head main",
    "# branch.upstream origin/main",
    "# branch.ab +2 -1",
    "1 .M N... 100644 100644 100644 aaa bbb README.md",
    "1 A. N... 000000 100644 100644 000 ccc dir/new file.txt",
    "2 R. N... 100644 100644 100644 ddd ddd R100 renamed.txt",
    "old.txt",
    "u UU N... 100644 100644 100644 100644 e f g both.txt",
    "? untracked.txt",
    "",
  ].join("\0");
  const st = parseStatus(out);
  assert.equal(st.branch, "main");
  assert.equal(st.upstream, "origin/main");
  assert.deepEqual([st.ahead, st.behind, st.clean, st.detached], [2, 1, false, false]);
  assert.deepEqual(
    st.files.map((f) => [f.path, f.status, f.index, f.worktree, f.original_path]),
    [
      ["README.md", "modified", ".", "M", undefined],
      ["dir/new file.txt", "added", "A", ".", undefined],
      ["renamed.txt", "renamed", "R", ".", "old.txt"],
      ["both.txt", "conflicted", "U", "U", undefined],
      ["untracked.txt", "untracked", "?", "?", undefined],
    ],
  );
  const fresh = parseStatus("# branch.oid (initial)\0# branch.head main\0");
  assert.deepEqual([fresh.commit, fresh.upstream, fresh.clean], [null, null, true]);
  assert.equal(parseStatus("# branch.oid abc\0# branch.head (detached)\0").detached, true);
});

test("clone URLs: remote helpers, option-like URLs and passwords in URLs are refused", () => {
  for (const bad of ["ext::sh -c id", "fd::3", "-u", "https://me:tok@github.com/a/b.git", "http://x:y@h/r", "https://token@h/r.git", "HTTPS://tok%40en@h/r", "ssh://u:pass@h/r", "https://h\n/r"]) assert.throws(() => checkCloneUrl(bad), KilnError, bad);
  for (const ok of ["https://github.com/a/b.git", "ssh://git@h:2222/r.git", "git@github.com:a/b.git", "/srv/repo.git", "file:///srv/r", "https://h/r?x=a@b"]) checkCloneUrl(ok);
});

test("credentials are checked by kind", () => {
  assert.doesNotThrow(() => checkAuth({ kind: "https", username: "u", password: "p" }));
  assert.doesNotThrow(() => checkAuth({ kind: "ssh", private_key: "k", passphrase: "" }));
  assert.throws(() => checkAuth({ kind: "https", username: "u" }), /username and password/);
  assert.throws(() => checkAuth({ kind: "ssh" }), /private_key/);
  assert.throws(() => checkAuth({ kind: "https", username: "u", password: "p", private_key: "k" }), /kind ssh/);
});

test("scrubbing removes every credential and URL userinfo from git's output", () => {
  const key = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\nAAAAMwAAAAtzc2gtZWQy\n-----END OPENSSH PRIVATE KEY-----\n";
  const secrets = secretsOf({ kind: "ssh", private_key: key, passphrase: "hunter22" });
  const text = `Load key: b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ passphrase hunter22; fetching https://bob:s3cret@h/r.git`;
  const out = scrub(text, secrets);
  assert.ok(!out.includes("hunter22") && !out.includes("b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ") && !out.includes("s3cret"), out);
  assert.match(out, /https:\/\/\[redacted\]@h\/r\.git/);
  assert.equal(scrub("to https://user:pw@x/y", secretsOf({ kind: "https", username: "user", password: "pw" })), "to https://[redacted]@x/y");
});

test("a JavaScript cell without await runs as it is; with top-level await, declarations outlive it", async () => {
  assert.deepEqual(compileCell("let a = 1; a + 1"), { source: "let a = 1; a + 1", async: false });
  assert.equal(compileCell("async function f() { await 1 }").async, false, "await inside a function is not top-level");
  assert.equal(compileCell("for await (const x of y) {}").async, true);
  const cell = compileCell("const { p, q: [r] } = await Promise.resolve({ p: 1, q: [2] });\nfunction twice(n) { return n * 2 }\nclass K {}\ntwice(p + r)");
  assert.equal(cell.async, true);
  const ctx: Record<string, unknown> = { Promise };
  const value = await runInNewContext(cell.source, ctx);
  assert.equal(value, 6);
  assert.equal(ctx.p, 1);
  assert.equal(ctx.r, 2);
  assert.equal(typeof ctx.twice, "function");
  assert.equal(typeof ctx.K, "function");
  assert.equal(compileCell("syntax error here (").async, false, "the VM reports syntax errors itself");
});
