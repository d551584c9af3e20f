// Git remotes and git credentials against a hostile or careless caller, with a real git server on loopback (smart
// HTTP with Basic auth, and sshd): a credential marker sent through every git operation — clone, fetch, pull, push
// with set_upstream, and URLs carrying user info — is never found afterwards in the machine's files (the repository,
// home, /tmp, /dev/shm), in its disk image (even flushed while the operation ran), in Kiln's data dir or in its log;
// and set_upstream records `branch.<name>.remote`/`merge` as `git push -u` does.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { randomUUID } from "node:crypto";
import { createReadStream } from "node:fs";
import { mkdtemp, readdir, rm } from "node:fs/promises";
import { connect, createServer } from "node:net";
import type { Server, Socket } from "node:net";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { commitOnServer, filesContaining, HTTP_USER, makeBareRepo, serverLog, startHttpGitServer, startSshGitServer } from "../gitcode/git-servers.ts";
import type { HttpGitServer, SshGitServer } from "../gitcode/git-servers.ts";

/** A TCP gate in front of a server: while held, connections wait (so an operation can be caught mid-way). */
interface Gate {
  port: number;
  connections: number;
  hold(): void;
  release(): void;
  /** Resolves when a connection arrives while held. */
  waiting(): Promise<void>;
  close(): Promise<void>;
}

async function startGate(targetPort: number): Promise<Gate> {
  let held: Promise<void> | undefined;
  let open = () => undefined as void;
  let arrived = () => undefined as void;
  let arrival: Promise<void> = Promise.resolve();
  const sockets = new Set<Socket>();
  const state = { connections: 0 };
  const server: Server = createServer((client) => {
    state.connections++;
    sockets.add(client);
    client.on("close", () => sockets.delete(client));
    client.on("error", () => undefined);
    client.pause();
    arrived();
    void (held ?? Promise.resolve()).then(() => {
      const upstream = connect(targetPort, "127.0.0.1");
      sockets.add(upstream);
      upstream.on("error", () => client.destroy());
      upstream.on("close", () => sockets.delete(upstream));
      client.pipe(upstream);
      upstream.pipe(client);
      client.on("close", () => upstream.destroy());
      upstream.on("close", () => client.destroy());
      client.resume();
    });
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  return {
    port: (server.address() as AddressInfo).port,
    get connections() {
      return state.connections;
    },
    hold() {
      held = new Promise<void>((r) => (open = r));
      arrival = new Promise<void>((r) => (arrived = r));
    },
    release() {
      open();
      held = undefined;
    },
    waiting: () => arrival,
    async close() {
      for (const s of sockets) s.destroy();
      await new Promise((r) => server.close(r));
    },
  };
}

let k: TestKiln;
let http: HttpGitServer;
let ssh: SshGitServer;
let httpGate: Gate;
let sshGate: Gate;
let root: string;
let m: any;
let repo: string;
const goodPasswords = new Set<string>();

before(async () => {
  root = await mkdtemp(join(tmpdir(), "kiln-sec-git-"));
  repo = await makeBareRepo(root, "app.git");
  http = await startHttpGitServer(root, (p) => goodPasswords.has(p));
  ssh = await startSshGitServer(`pp-${randomUUID()}`);
  httpGate = await startGate(http.port);
  sshGate = await startGate(ssh.port);
  k = await startTestKiln({ env: { KILN_MACHINE_HOST_ACCESS: "1", KILN_WARM_POOL: "0" } });
  // The machine's own environment asks git to trace everything it sends, unredacted: credentials must still land nowhere.
  const envs = { GIT_TRACE: "/tmp/git-trace", GIT_TRACE_CURL: "/tmp/git-trace-curl", GIT_TRACE_PACKET: "/tmp/git-trace-packet", GIT_TRACE_REDACT: "0", GIT_CURL_VERBOSE: "1" };
  const res = await k.call("POST", "/v1/machines", { body: { disk_mb: 256, envs } });
  assert.equal(res.status, 201, res.text);
  m = res.body;
});
after(async () => {
  await k?.close();
  await httpGate?.close();
  await sshGate?.close();
  await http?.close();
  await ssh?.close();
  if (root) await rm(root, { recursive: true, force: true });
});

const httpUrl = () => `http://host.kiln.internal:${httpGate.port}/app.git`;
const git = (op: string, body: Record<string, unknown>) => k.call("POST", `/v1/machines/${m.id}/git/${op}`, { body });

function marker(): string {
  const p = `marker-${randomUUID()}`;
  goodPasswords.add(p);
  return p;
}

async function sh(cmd: string, user = "root", stdin?: string) {
  const res = await k.call("POST", `/v1/machines/${m.id}/exec`, { body: { cmd, user, stdin, timeout_s: 120 } });
  assert.equal(res.status, 200, res.text);
  return res.body as { exit_code: number; stdout: string; stderr: string };
}

/** Runs a git operation caught mid-way: once it connected to the server, the machine's disk is flushed, then it goes on. */
async function flushedMidway(gate: Gate, op: string, body: Record<string, unknown>) {
  gate.hold();
  const running = git(op, body);
  await gate.waiting();
  await sh("sync");
  gate.release();
  return running;
}

/** The machine's disk image(s) under the data dir. */
async function diskImages(): Promise<string[]> {
  const out: string[] = [];
  const walk = async (d: string) => {
    for (const e of await readdir(d, { withFileTypes: true }).catch(() => [])) {
      const p = join(d, e.name);
      if (e.isDirectory() && !(e.name === "rootfs" && d.includes("/machines/"))) await walk(p);
      else if (e.isFile() && (e.name === "disk.img" || e.name === `${m.id}.img`) && p.includes(m.id)) out.push(p); // in its dir, or in the reflink pool
    }
  };
  await walk(k.dataDir);
  return out;
}

/** Whether a file's bytes hold the needle, read in chunks (a disk image is far larger than what it holds). */
async function fileHolds(path: string, needle: string): Promise<boolean> {
  const want = Buffer.from(needle);
  let tail = Buffer.alloc(0);
  for await (const chunk of createReadStream(path, { highWaterMark: 8 * 1024 * 1024 })) {
    const window = Buffer.concat([tail, chunk as Buffer]);
    if (window.includes(want)) return true;
    tail = window.subarray(Math.max(0, window.length - want.length + 1));
  }
  return false;
}

/** The secret is nowhere: the machine's files and processes, its memory filesystem, its disk image, Kiln's data dir and log. */
async function assertNowhere(secret: string) {
  await sh("sync");
  // The pattern goes through stdin, so the search itself never puts the secret in an argv.
  const found = await sh("grep -rlF --exclude-dir=proc --exclude-dir=sys -f - / /dev/shm 2>/dev/null; true", "root", secret);
  assert.equal(found.stdout.trim(), "", `the secret is in the machine's files: ${found.stdout}`);
  const ps = await sh("ps -eo args; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'");
  assert.ok(!ps.stdout.includes(secret), "the secret is in a process's argv or environment");
  const left = await sh("ls -a /tmp /dev/shm");
  assert.ok(!/kiln-git-/.test(left.stdout), `a scratch dir is left: ${left.stdout}`);
  const images = await diskImages();
  if (process.env.KILN_OCI_RUNTIME !== "runsc") assert.ok(images.length > 0, "the machine's disk image was found");
  for (const image of images) assert.equal(await fileHolds(image, secret), false, `the secret is in the machine's disk image ${image}`);
  assert.deepEqual(await filesContaining(k.dataDir, secret), [], "the secret is in Kiln's data dir");
  assert.ok(!k.logs.join("").includes(secret), "the secret is in Kiln's log");
}

test("clone, fetch, pull and push with set_upstream carry a password that lands nowhere, the disk flushed mid-operation; set_upstream records the upstream", async () => {
  const password = marker();
  const basic = Buffer.from(`${HTTP_USER}:${password}`).toString("base64");
  const auth = { kind: "https", username: HTTP_USER, password };
  const clone = await flushedMidway(httpGate, "clone", { url: httpUrl(), path: "/workspace/app", auth });
  assert.equal(clone.status, 200, clone.text);
  assert.ok(!clone.text.includes(basic), "git's traces never come back");

  await sh("cd /workspace/app && git switch -q -c feature/sec && echo f > f.txt", "user");
  assert.equal((await git("add", { path: "/workspace/app" })).status, 200);
  assert.equal((await git("commit", { path: "/workspace/app", message: "sec", author_name: "S", author_email: "s@s.s" })).status, 200);
  const push = await flushedMidway(httpGate, "push", { path: "/workspace/app", set_upstream: true, auth });
  assert.equal(push.status, 200, push.text);
  assert.match(push.body.summary, /feature\/sec -> feature\/sec/);
  assert.ok(!push.body.summary.includes(basic));
  const config = await sh("git config --file /workspace/app/.git/config --get-regexp '^branch\\.feature/sec\\.'", "user");
  assert.match(config.stdout, /^branch\.feature\/sec\.remote origin$/m);
  assert.match(config.stdout, /^branch\.feature\/sec\.merge refs\/heads\/feature\/sec$/m);
  assert.match(serverLog(repo, "feature/sec"), /sec/);

  await commitOnServer(repo, "theirs.txt", "theirs\n");
  await sh("cd /workspace/app && git switch -q main", "user");
  assert.equal((await flushedMidway(httpGate, "fetch", { path: "/workspace/app", auth })).status, 200);
  const pull = await flushedMidway(httpGate, "pull", { path: "/workspace/app", auth });
  assert.equal(pull.status, 200, pull.text);
  assert.equal((await sh("cat /workspace/app/theirs.txt")).stdout, "theirs\n");

  // A remote given as an address (no user info) with set_upstream: the address is recorded, nothing else.
  await sh("cd /workspace/app && echo u > u.txt && git add u.txt && git -c user.name=a -c user.email=a@b commit -qm u", "user");
  const byUrl = await git("push", { path: "/workspace/app", remote: httpUrl(), branch: "main", set_upstream: true, auth });
  assert.equal(byUrl.status, 200, byUrl.text);
  const mainUp = await sh("git -C /workspace/app config --get-regexp '^branch\\.main\\.'", "user");
  assert.match(mainUp.stdout, new RegExp(`^branch\\.main\\.remote ${httpUrl().replace(/[.]/g, "\\.")}$`, "m"));
  assert.match(mainUp.stdout, /^branch\.main\.merge refs\/heads\/main$/m);
  await assertNowhere(password);
  await assertNowhere(basic);
});

test("a URL carrying user info is refused (400) by clone, push, pull and fetch before git runs, in every spelling", async () => {
  const secret = `marker-${randomUUID()}`;
  const host = `host.kiln.internal:${httpGate.port}`;
  const before = httpGate.connections;
  const urls = [
    `http://${HTTP_USER}:${secret}@${host}/app.git`,
    `HTTP://${HTTP_USER}:${secret}@${host}/app.git`,
    `https://${secret}@${host}/app.git`, // a token as the user name
    `http://${encodeURIComponent(`${HTTP_USER}:${secret}`)}@${host}/app.git`,
    `ssh://git:${secret}@${host}/app.git`,
    `http://x@y:${secret}@${host}/app.git`,
  ];
  for (const url of urls) {
    const clone = await git("clone", { url, path: "/workspace/evil" });
    assert.equal(clone.status, 400, `clone ${url} → ${clone.text}`);
    assert.equal(clone.body.code, "invalid_request");
    assert.ok(!clone.text.includes(secret), "the refusal does not echo the secret");
    for (const op of ["push", "pull", "fetch"]) {
      const res = await git(op, { path: "/workspace/app", remote: url, ...(op === "push" ? { branch: "main", set_upstream: true } : {}) });
      assert.equal(res.status, 400, `${op} ${url} → ${res.text}`);
      assert.ok(!res.text.includes(secret));
    }
  }
  for (const url of ["ext::sh -c id", "fd::17"]) for (const op of ["push", "pull", "fetch"]) assert.equal((await git(op, { path: "/workspace/app", remote: url })).status, 400, `${op} ${url}`);
  assert.equal(httpGate.connections, before, "git never reached the server");
  assert.equal((await sh("ls /workspace/evil 2>&1; true")).stdout.includes("No such file"), true);
  await assertNowhere(secret);
});

test("as a user would: a repository made in the machine, pushed with set_upstream and no branch, tracks origin/main", async () => {
  const password = marker();
  await sh(
    `set -e; git init -q -b main /workspace/fresh; cd /workspace/fresh; git remote add origin ${httpUrl().replace("app.git", "fresh.git")}; echo hi > hi.txt; git add hi.txt; git -c user.name=U -c user.email=u@u.u commit -qm first`,
    "user",
  );
  // An empty repository on the server, as a new project's would be.
  execFileSync("git", ["init", "--quiet", "--bare", "-b", "main", join(root, "fresh.git")], { stdio: "pipe" });
  execFileSync("git", ["config", "http.receivepack", "true"], { cwd: join(root, "fresh.git"), stdio: "pipe" });
  const push = await git("push", { path: "/workspace/fresh", set_upstream: true, auth: { kind: "https", username: HTTP_USER, password } });
  assert.equal(push.status, 200, push.text);
  const config = await sh("cat /workspace/fresh/.git/config", "user");
  assert.match(config.stdout, /\[branch "main"\]\s+remote = origin\s+merge = refs\/heads\/main/);
  const status = await git("status", { path: "/workspace/fresh" });
  assert.equal(status.body.upstream, "origin/main");
  await assertNowhere(password);
});

test("an SSH key and its passphrase land nowhere, the disk flushed mid-operation", async () => {
  const auth = { kind: "ssh", private_key: ssh.keys.encrypted, passphrase: ssh.keys.passphrase };
  const url = `ssh://root@host.kiln.internal:${sshGate.port}${await makeBareRepo(root, "ssh.git")}`;
  const clone = await flushedMidway(sshGate, "clone", { url, path: "/workspace/ssh", auth });
  assert.equal(clone.status, 200, clone.text);
  await assertNowhere(ssh.keys.passphrase);
  await assertNowhere(ssh.keys.encrypted.split("\n")[1]);
});

test("the search finds a secret that is there: in the machine's files, and in its disk image after a flush", async () => {
  const planted = `planted-${randomUUID()}`;
  await sh(`echo ${planted} > /tmp/planted.txt && sync && rm /tmp/planted.txt && sync`);
  if (process.env.KILN_OCI_RUNTIME !== "runsc") {
    const images = await diskImages();
    assert.ok(images.length > 0);
    assert.ok((await Promise.all(images.map((i) => fileHolds(i, planted)))).some(Boolean), "a deleted file's bytes stay in the disk image: the image search can fail");
  }
  await sh(`echo ${planted} > /dev/shm/planted.txt`);
  await assert.rejects(assertNowhere(planted), /machine's files/);
  await sh("rm -f /dev/shm/planted.txt");
});
