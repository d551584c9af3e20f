// Local fixtures for build steps that fetch (machines cannot reach PyPI or npm here): one static HTTP server on
// loopback, reached from machines as host.kiln.internal, serving a tiny wheel index, a file, an npm tarball and a
// bare git repository over git's dumb HTTP protocol. Everything is made by the test in a temp dir.

import { createServer } from "node:http";
import type { Server } from "node:http";
import { execFileSync } from "node:child_process";
import { mkdtempSync, mkdirSync, readFileSync, writeFileSync, statSync, existsSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, normalize } from "node:path";
import { sha256hex } from "./support.ts";

export interface Fixtures {
  port: number;
  /** http://host.kiln.internal:<port> */
  base: string;
  fileSha256: string;
  fileContent: string;
  close(): Promise<void>;
}

function makeWheel(dir: string) {
  // A wheel is a zip with the package and its dist-info; /usr/bin/python3's zipfile writes it.
  const script = `
import zipfile, hashlib, base64
files = {"kilnpkg/__init__.py": "VALUE = 'from the local index'\\n",
         "kilnpkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\\nName: kilnpkg\\nVersion: 1.0\\n",
         "kilnpkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\\nGenerator: kiln-test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}
record = []
for name, text in files.items():
    d = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{name},sha256={d},{len(text.encode())}")
record.append("kilnpkg-1.0.dist-info/RECORD,,")
with zipfile.ZipFile("${dir}/kilnpkg-1.0-py3-none-any.whl", "w") as z:
    for name, text in files.items(): z.writestr(name, text)
    z.writestr("kilnpkg-1.0.dist-info/RECORD", "\\n".join(record) + "\\n")
`;
  execFileSync("/usr/bin/python3", ["-c", script]);
}

function makeNpmTarball(root: string) {
  const pkg = join(root, "npm-src", "package");
  mkdirSync(pkg, { recursive: true });
  writeFileSync(join(pkg, "package.json"), JSON.stringify({ name: "kiln-fixture", version: "1.0.0", main: "index.js" }));
  writeFileSync(join(pkg, "index.js"), "module.exports = 'from the local tarball';\n");
  execFileSync("tar", ["-czf", join(root, "kiln-fixture-1.0.0.tgz"), "-C", join(root, "npm-src"), "package"]);
}

function makeGitRepo(root: string) {
  const work = join(root, "git-work");
  mkdirSync(work);
  const git = (args: string[], cwd: string) => execFileSync("git", args, { cwd, env: { ...process.env, GIT_AUTHOR_NAME: "t", GIT_AUTHOR_EMAIL: "t@t", GIT_COMMITTER_NAME: "t", GIT_COMMITTER_EMAIL: "t@t" } });
  git(["init", "-q", "-b", "main"], work);
  writeFileSync(join(work, "README"), "cloned from the local repo\n");
  git(["add", "README"], work);
  git(["commit", "-q", "-m", "first"], work);
  git(["clone", "-q", "--bare", work, join(root, "repo.git")], root);
  git(["update-server-info"], join(root, "repo.git"));
}

/** `npmCli` also serves npm itself (the host's copy, tarred), for images that have no npm. */
export async function startFixtures(opts: { npmCli?: boolean } = {}): Promise<Fixtures> {
  const root = mkdtempSync(join(tmpdir(), "kiln-build-fixtures-"));
  mkdirSync(join(root, "simple", "kilnpkg"), { recursive: true });
  makeWheel(root);
  writeFileSync(join(root, "simple", "index.html"), `<html><body><a href="/simple/kilnpkg/">kilnpkg</a></body></html>`);
  const wheelSha = sha256hex(readFileSync(join(root, "kilnpkg-1.0-py3-none-any.whl")));
  writeFileSync(join(root, "simple", "kilnpkg", "index.html"), `<html><body><a href="/kilnpkg-1.0-py3-none-any.whl#sha256=${wheelSha}">kilnpkg-1.0-py3-none-any.whl</a></body></html>`);
  const fileContent = "#!/bin/sh\necho downloaded tool\n";
  writeFileSync(join(root, "tool.sh"), fileContent);
  makeNpmTarball(root);
  makeGitRepo(root);
  if (opts.npmCli) execFileSync("tar", ["-czf", join(root, "npm-cli.tgz"), "-C", "/usr/lib/node_modules", "npm"]);
  const server: Server = createServer((req, res) => {
    let path = normalize(decodeURIComponent((req.url ?? "/").split("?")[0]));
    if (path.includes("..")) return void res.writeHead(400).end();
    let file = join(root, path);
    if (existsSync(file) && statSync(file).isDirectory()) file = join(file, "index.html");
    if (!existsSync(file)) return void res.writeHead(404).end("not found");
    res.writeHead(200, { "content-type": file.endsWith(".html") ? "text/html" : "application/octet-stream" });
    res.end(readFileSync(file));
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", () => r()));
  const port = (server.address() as { port: number }).port;
  return {
    port,
    base: `http://host.kiln.internal:${port}`,
    fileSha256: sha256hex(fileContent),
    fileContent,
    async close() {
      server.closeAllConnections();
      await new Promise<void>((r) => server.close(() => r()));
      rmSync(root, { recursive: true, force: true });
    },
  };
}
