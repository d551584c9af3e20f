// Real git servers on loopback for the git tests: bare repositories served over smart HTTP (git http-backend behind
// a small Node server with Basic auth) and over SSH (Debian's sshd with its own config, host key and test keys).

import { spawn, execFileSync } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { createServer } from "node:http";
import type { Server } from "node:http";
import { mkdtemp, readFile, rm, writeFile, mkdir, chmod } from "node:fs/promises";
import { existsSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { AddressInfo } from "node:net";
import { freePort } from "../support/net.ts";

export const HTTP_USER = "kiln-tester";

/** A bare repository under `root` with one commit on main (README), pushable over HTTP. */
export async function makeBareRepo(root: string, name: string): Promise<string> {
  const bare = join(root, name);
  const git = (args: string[], cwd?: string) => execFileSync("git", args, { cwd, stdio: "pipe", env: { ...process.env, GIT_CONFIG_NOSYSTEM: "1", HOME: root } });
  git(["init", "--quiet", "--bare", "-b", "main", bare]);
  git(["config", "http.receivepack", "true"], bare);
  const seed = join(root, `${name}.seed`);
  git(["init", "--quiet", "-b", "main", seed]);
  await writeFile(join(seed, "README.md"), "# test repo\n");
  git(["add", "README.md"], seed);
  git(["-c", "user.name=Seeder", "-c", "user.email=seed@test", "commit", "--quiet", "-m", "seed"], seed);
  git(["push", "--quiet", bare, "main"], seed);
  await rm(seed, { recursive: true, force: true });
  return bare;
}

/** Commits a file to `bare` from the host, as another contributor would (for pull and rejected-push cases). */
export async function commitOnServer(bare: string, file: string, text: string): Promise<string> {
  const work = await mkdtemp(join(tmpdir(), "kiln-git-contrib-"));
  const env = { ...process.env, GIT_CONFIG_NOSYSTEM: "1", HOME: work };
  const git = (args: string[]) => execFileSync("git", args, { cwd: work, stdio: "pipe", env }).toString();
  try {
    git(["clone", "--quiet", bare, "."]);
    await writeFile(join(work, file), text);
    git(["add", file]);
    git(["-c", "user.name=Other", "-c", "user.email=other@test", "commit", "--quiet", "-m", `add ${file}`]);
    git(["push", "--quiet", "origin", "HEAD"]);
    return git(["rev-parse", "HEAD"]).trim();
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

export function serverLog(bare: string, ref = "main"): string {
  return execFileSync("git", ["--git-dir", bare, "log", "--format=%H %an <%ae> %s", ref], { stdio: "pipe" }).toString();
}

export interface HttpGitServer {
  port: number;
  /** Requests that carried the right Basic credentials (the password is checked by `accepts`). */
  authorized: number;
  close(): Promise<void>;
}

/**
 * Smart HTTP: every request needs Basic auth with HTTP_USER and a password `accepts` approves; it is then handed
 * to `git http-backend` as CGI (body on stdin, headers and status parsed back from its output).
 */
export async function startHttpGitServer(projectRoot: string, accepts: (password: string) => boolean): Promise<HttpGitServer> {
  const state = { authorized: 0 };
  const server: Server = createServer((req, res) => {
    const header = req.headers.authorization ?? "";
    const decoded = header.startsWith("Basic ") ? Buffer.from(header.slice(6), "base64").toString() : "";
    const sep = decoded.indexOf(":");
    if (sep < 0 || decoded.slice(0, sep) !== HTTP_USER || !accepts(decoded.slice(sep + 1))) {
      res.writeHead(401, { "www-authenticate": 'Basic realm="kiln-test"', "content-type": "text/plain" });
      return res.end("unauthorized\n");
    }
    state.authorized++;
    const url = new URL(req.url ?? "/", "http://x");
    const cgi = spawn("git", ["http-backend"], {
      env: {
        PATH: process.env.PATH,
        GIT_PROJECT_ROOT: projectRoot,
        GIT_HTTP_EXPORT_ALL: "1",
        GIT_CONFIG_NOSYSTEM: "1",
        HOME: projectRoot,
        PATH_INFO: decodeURIComponent(url.pathname),
        QUERY_STRING: url.search.slice(1),
        REQUEST_METHOD: req.method ?? "GET",
        CONTENT_TYPE: req.headers["content-type"] ?? "",
        HTTP_CONTENT_ENCODING: String(req.headers["content-encoding"] ?? ""),
        GIT_PROTOCOL: String(req.headers["git-protocol"] ?? ""),
        REMOTE_USER: HTTP_USER,
        REMOTE_ADDR: "127.0.0.1",
      },
      stdio: ["pipe", "pipe", "ignore"],
    });
    req.pipe(cgi.stdin);
    cgi.stdin.on("error", () => undefined);
    let head = Buffer.alloc(0);
    let headersDone = false;
    cgi.stdout.on("data", (chunk: Buffer) => {
      if (headersDone) return void res.write(chunk);
      head = Buffer.concat([head, chunk]);
      const end = head.indexOf("\r\n\r\n");
      if (end < 0) return;
      headersDone = true;
      let status = 200;
      const headers: Record<string, string> = {};
      for (const line of head.subarray(0, end).toString().split("\r\n")) {
        const i = line.indexOf(":");
        const k = line.slice(0, i).trim();
        const v = line.slice(i + 1).trim();
        if (k.toLowerCase() === "status") status = Number(v.split(" ")[0]);
        else headers[k] = v;
      }
      res.writeHead(status, headers);
      res.write(head.subarray(end + 4));
    });
    cgi.stdout.on("end", () => res.end());
    cgi.on("error", () => res.destroy());
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = (server.address() as AddressInfo).port;
  return {
    port,
    get authorized() {
      return state.authorized;
    },
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  };
}

export interface SshKeys {
  /** An unencrypted ed25519 key (OpenSSH format) and one encrypted with `passphrase`. */
  plain: string;
  encrypted: string;
  passphrase: string;
}

export interface SshGitServer {
  port: number;
  keys: SshKeys;
  close(): Promise<void>;
}

/**
 * sshd on 127.0.0.1:<free port> with a config, host key and authorized_keys of its own in a temp dir. Logins are
 * root by key only, `restrict`ed (no forwarding, no pty): enough to run git-upload-pack/git-receive-pack.
 */
export async function startSshGitServer(passphrase: string): Promise<SshGitServer> {
  if (!existsSync("/usr/sbin/sshd")) throw new Error("sshd is missing: apt-get install openssh-server (scripts/up.sh installs it)");
  const dir = await mkdtemp(join(tmpdir(), "kiln-sshd-"));
  await chmod(dir, 0o700);
  const keygen = (file: string, pass: string) => execFileSync("ssh-keygen", ["-q", "-t", "ed25519", "-N", pass, "-C", "kiln-test", "-f", file], { stdio: "pipe" });
  keygen(join(dir, "host_key"), "");
  keygen(join(dir, "client_plain"), "");
  keygen(join(dir, "client_encrypted"), passphrase);
  const pubs = [await readFile(join(dir, "client_plain.pub"), "utf8"), await readFile(join(dir, "client_encrypted.pub"), "utf8")];
  await writeFile(join(dir, "authorized_keys"), pubs.map((p) => `restrict ${p.trim()}\n`).join(""), { mode: 0o600 });
  await mkdir("/run/sshd", { recursive: true, mode: 0o755 });
  const port = await freePort();
  await writeFile(
    join(dir, "sshd_config"),
    [
      `Port ${port}`,
      "ListenAddress 127.0.0.1",
      `HostKey ${dir}/host_key`,
      `AuthorizedKeysFile ${dir}/authorized_keys`,
      `PidFile ${dir}/sshd.pid`,
      "PermitRootLogin prohibit-password",
      "AllowUsers root",
      "PasswordAuthentication no",
      "KbdInteractiveAuthentication no",
      "PubkeyAuthentication yes",
      "UsePAM no",
      "StrictModes no",
      "X11Forwarding no",
      "AllowTcpForwarding no",
      "PrintMotd no",
      "LogLevel ERROR",
      "",
    ].join("\n"),
  );
  const child: ChildProcess = spawn("/usr/sbin/sshd", ["-D", "-e", "-f", join(dir, "sshd_config")], { stdio: ["ignore", "ignore", "pipe"] });
  let stderr = "";
  child.stderr!.on("data", (b: Buffer) => (stderr += b.toString()));
  // Ready when the port accepts connections (sshd has no readiness signal of its own in -D mode).
  const deadline = Date.now() + 10_000;
  while (!(await canConnect(port))) {
    if (child.exitCode !== null || Date.now() > deadline) {
      child.kill("SIGKILL");
      throw new Error(`sshd did not start: ${stderr}`);
    }
    await new Promise((r) => setTimeout(r, 25));
  }
  return {
    port,
    keys: { plain: await readFile(join(dir, "client_plain"), "utf8"), encrypted: await readFile(join(dir, "client_encrypted"), "utf8"), passphrase },
    async close() {
      if (child.exitCode === null) {
        const exited = new Promise((r) => child.once("exit", r));
        child.kill("SIGTERM");
        await exited;
      }
      await rm(dir, { recursive: true, force: true });
    },
  };
}

async function canConnect(port: number): Promise<boolean> {
  const { connect } = await import("node:net");
  return new Promise((resolve) => {
    const sock = connect({ host: "127.0.0.1", port });
    sock.once("connect", () => {
      sock.destroy();
      resolve(true);
    });
    sock.once("error", () => resolve(false));
  });
}

/**
 * Every regular file under `dir` (not following links) whose bytes contain `needle`. A machine's mounted root
 * (`machines/<id>/rootfs`) is skipped: its writes are all in the `upper` dir beside it, which is searched.
 */
export async function filesContaining(dir: string, needle: string): Promise<string[]> {
  const { readdir, lstat } = await import("node:fs/promises");
  const hits: string[] = [];
  const want = Buffer.from(needle);
  const walk = async (d: string) => {
    for (const e of await readdir(d, { withFileTypes: true }).catch(() => [])) {
      const p = join(d, e.name);
      if (e.isDirectory()) {
        if (e.name === "rootfs" && d.includes("/machines/")) continue;
        await walk(p);
      }
      else if (e.isFile()) {
        const st = await lstat(p).catch(() => undefined);
        if (!st || st.size > 256 * 1024 * 1024) continue;
        const bytes = await readFile(p).catch(() => undefined);
        if (bytes?.includes(want)) hits.push(p);
      }
    }
  };
  await walk(dir);
  return hits;
}
