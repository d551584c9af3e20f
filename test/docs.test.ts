// Docs that point somewhere and commands that still work (issue 24, item 9): every link and file reference in
// README.md and docs/ resolves inside the repository, none cites a file users do not have, every `bin/kiln` command
// and flag they show exists, and the README's quick start runs as written against a real server.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFile, spawnSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { mkdtemp, mkdir, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join, relative, resolve } from "node:path";
import { promisify } from "node:util";
import { startTestKiln, TEST_KEY } from "./support/kiln.ts";
import type { TestKiln } from "./support/kiln.ts";
import type { Command } from "commander";
import { kilnProgram } from "../src/cli/program.ts";

const ROOT = resolve(import.meta.dirname, "..");
const run = promisify(execFile);

function markdownFiles(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) => (e.isDirectory() ? markdownFiles(join(dir, e.name)) : e.name.endsWith(".md") ? [join(dir, e.name)] : []));
}
const DOCS = [join(ROOT, "README.md"), ...markdownFiles(join(ROOT, "docs"))];
const read = (f: string) => readFileSync(f, "utf8");
const where = (f: string, text: string, at: number) => `${relative(ROOT, f)}:${text.slice(0, at).split("\n").length}`;

/** Fenced code blocks of a markdown file with their info string. */
function codeBlocks(text: string): { lang: string; body: string }[] {
  return [...text.matchAll(/^```(\w*)\n([\s\S]*?)^```/gm)].map((m) => ({ lang: m[1]!, body: m[2]! }));
}

test("every relative link in README.md and docs/ points at a file in the repository", () => {
  const broken: string[] = [];
  for (const f of DOCS) {
    const text = read(f);
    for (const m of text.matchAll(/\]\(([^)\s]+)\)/g)) {
      const target = m[1]!;
      if (/^(https?:|mailto:|#)/.test(target)) continue;
      if (!existsSync(resolve(dirname(f), target.split("#")[0]!))) broken.push(`${where(f, text, m.index!)} → ${target}`);
    }
  }
  assert.deepEqual(broken, []);
});

test("every repository path named in README.md and docs/ exists", () => {
  const missing: string[] = [];
  for (const f of DOCS) {
    const text = read(f);
    // `src/…/x.ts`, `docs/x.md`, `scripts/up.sh`, `bench/…`, `test/…`, `bin/kiln`: concrete paths (no …, *, <…>, $).
    for (const m of text.matchAll(/`((?:src|docs|test|bench|scripts|bin)\/[A-Za-z0-9_./-]+)`/g)) {
      const path = m[1]!.replace(/[.,:;]+$/, "");
      if (!existsSync(join(ROOT, path))) missing.push(`${where(f, text, m.index!)} → ${path}`);
    }
  }
  assert.deepEqual(missing, []);
});

test("README.md, docs/ and the CLI's help cite no file users do not have", () => {
  const cited: string[] = [];
  for (const f of DOCS) {
    const text = read(f);
    for (const m of text.matchAll(/\b(SPEC|DESIGN)\.md\b/g)) cited.push(`${where(f, text, m.index!)} → ${m[0]}`);
  }
  for (const name of readdirSync(join(ROOT, "src", "cli"))) {
    const f = join(ROOT, "src", "cli", name);
    const text = read(f);
    // Strings only (help and messages), not comments for developers.
    for (const m of text.matchAll(/["`][^"`\n]*\b(SPEC|DESIGN)\.md\b[^"`\n]*["`]/g)) cited.push(`${where(f, text, m.index!)} → ${m[0]}`);
  }
  assert.deepEqual(cited, []);
});

test("every bin/kiln command and flag shown in README.md and docs/ exists", async () => {
  // Command path → flags shown with it.
  const shown = new Map<string, Set<string>>();
  for (const f of DOCS) {
    for (const block of codeBlocks(read(f))) {
      for (const line of block.body.split("\n")) {
        const m = /^\s*bin\/kiln\s+(.*)$/.exec(line);
        if (!m) continue;
        // Flags are the CLI's own: quoted arguments and whatever follows `--` belong to the command run.
        const words = m[1]!.replace(/\s#.*$/, "").replace(/'[^']*'|"[^"]*"/g, "ARG").replace(/\s--\s.*$/, "").trim().split(/\s+/);
        const path: string[] = [];
        for (const w of words) {
          if (!/^[a-z][a-z-]*$/.test(w) || path.length === 2) break;
          path.push(w);
        }
        const flags = shown.get(path.join(" ")) ?? new Set<string>();
        for (const w of words) if (/^--?[a-z][a-z-]*$/.test(w) && w !== "--") flags.add(w);
        shown.set(path.join(" "), flags);
      }
    }
  }
  assert.ok(shown.size >= 10, `found ${shown.size} commands`);
  // The help of the real command tree (src/cli/program.ts), the text `bin/kiln <path> --help` prints; walked in this
  // process, since one CLI start per command would cost this file most of its time.
  const problems: string[] = [];
  const program = kilnProgram();
  for (const [path, flags] of shown) {
    let cmd: Command | undefined = program;
    for (const name of path.split(" ").filter(Boolean)) cmd = cmd?.commands.find((c) => c.name() === name || c.aliases().includes(name));
    if (!cmd) {
      problems.push(`bin/kiln ${path}: no such command`);
      continue;
    }
    const help = cmd.helpInformation();
    // A path that stopped at an argument (`templates build`, `machines exec mch_…`) must be a command, not a group.
    if (/^Usage: kiln \S+ \[options\] \[command\]/m.test(help) && path.split(" ").length === 1) continue;
    for (const flag of flags) if (!new RegExp(`(^|[\\s,])${flag}([\\s,=<]|$)`, "m").test(help)) problems.push(`bin/kiln ${path} has no ${flag}`);
  }
  assert.deepEqual(problems, []);
});

let k: TestKiln | undefined;
let dir: string | undefined;
after(async () => {
  await k?.close();
  if (dir) await rm(dir, { recursive: true, force: true });
});

test("the README's quick start runs as written", { skip: spawnSync("jq", ["--version"]).status !== 0 && "jq is not installed (scripts/up.sh installs it)" }, async () => {
  k = await startTestKiln();
  dir = await mkdtemp(join(tmpdir(), "kiln-quickstart-"));
  // The quick start reads the key the server wrote into ./.kiln and talks to localhost:8080.
  await mkdir(join(dir, ".kiln"));
  await writeFile(join(dir, ".kiln", "api-key"), TEST_KEY + "\n");
  const readme = read(join(ROOT, "README.md"));
  const block = codeBlocks(readme).find((b) => b.body.includes("KEY=$(cat .kiln/api-key)"));
  assert.ok(block, "the README has its quick start block");
  // Each answer on its own line (curl prints none after a body), so the test can read them one by one.
  const script = `curl() { command curl "$@"; echo; }\n` + block!.body.replaceAll("localhost:8080", new URL(k.url).host);
  const r = await run("bash", ["-euo", "pipefail", "-c", script], { cwd: dir, timeout: 120_000 });
  const lines = r.stdout.trim().split("\n");
  assert.equal(lines[0], '{"status":"ok"}');
  assert.equal(JSON.parse(lines[1]!).status, "ready");
  const exec = JSON.parse(lines[2]!);
  assert.equal(exec.exit_code, 0);
  assert.equal(exec.stdout, "42\n");
  assert.equal(JSON.parse(lines[3]!).is_dir, true);
  assert.equal(JSON.parse(lines[4]!).status, "destroyed");
});
