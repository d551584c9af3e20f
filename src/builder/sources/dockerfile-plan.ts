// A Dockerfile whose one stage stands on a Kiln template, planned into the native executor's steps: one step per
// instruction, so each gets the declarative steps' layer cache (key: parent key, the instruction's text, the digests
// of the context files it copies, the digests of the build args it uses) and the template's layers are used as they
// are, never exported. Only the instructions whose meaning is plain are planned — RUN (shell or exec form, no
// flags, no heredoc), ENV, WORKDIR, USER, COPY (one source, --chown/--chmod), ARG, LABEL, EXPOSE — with no variable
// outside RUN; anything else (several stages, ADD, SHELL, CMD, RUN --mount, secrets, a `# escape=` directive…)
// answers why not, and the Dockerfile goes to the real builder as before.

import { createHmac, randomBytes } from "node:crypto";
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { join, posix } from "node:path";
import type { PlannedStep } from "../backends/backend.ts";
import type { Instruction } from "../dockerfile.ts";
import { shellQuote } from "../dockerfile.ts";

export interface DockerfilePlan {
  /** The FROM operand (a name to resolve as a Kiln template). */
  from: string;
  steps: PlannedStep[];
  /** Whether an instruction sets USER (else machines keep the template's user). */
  setsUser: boolean;
}

/**
 * Logical lines as Docker reads them: a backslash at a line's end — spaces and tabs after it allowed, as Docker's
 * `\\[ \t]*$` — joins the next (removed, not replaced); a blank line inside a continued instruction is skipped.
 */
function logicalLines(text: string): { text: string; line: number }[] {
  const out: { text: string; line: number }[] = [];
  let buf: string | null = null;
  let start = 0;
  const raw = text.split(/\r?\n/);
  for (let i = 0; i < raw.length; i++) {
    const l = raw[i];
    if (/^\s*#/.test(l)) continue; // a comment, alone or inside a continued instruction
    if (!l.trim()) continue; // blank: between instructions, or skipped inside a continued one (Docker's rule)
    if (buf === null) {
      start = i + 1;
      buf = "";
    }
    const continued = /\\[ \t]*$/.exec(l);
    if (continued) {
      buf += l.slice(0, continued.index);
      continue;
    }
    buf += l;
    out.push({ text: buf.trim(), line: start });
    buf = null;
  }
  if (buf !== null && buf.trim()) out.push({ text: buf.trim(), line: start });
  return out;
}

/** How many instructions (FROMs included) a Dockerfile has: the builder's `STEP n/m` numbering. */
export function instructionCount(text: string): number {
  return logicalLines(text).length;
}

const VAR = /\$/;
const REF = /\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))/g;

/**
 * `$NAME` and `${NAME}` replaced as Docker replaces them (the image's env first, then the build args in scope, else
 * empty); null when any other form (`${NAME:-x}`, an escaped `\$`) is left, which is the builder's.
 */
function expand(text: string, env: Map<string, string>, args: Map<string, string | undefined>): string | null {
  if (text.includes("\\") || VAR.test(text.replace(REF, ""))) return null;
  return text.replace(REF, (_, a: string | undefined, b: string | undefined) => env.get((a ?? b)!) ?? args.get((a ?? b)!) ?? "");
}

/** `K=V K2="v 2"` (no escapes) or the legacy `K V`, each value expanded: null when the form is not plain. */
function parseEnv(raw: string, env: Map<string, string>, args: Map<string, string | undefined>): [string, string][] | null {
  if (raw.includes("\\")) return null;
  const rest = raw;
  if (!/^[A-Za-z_][A-Za-z0-9_]*=/.test(rest)) {
    const m = /^([A-Za-z_][A-Za-z0-9_]*)\s+(.*)$/.exec(rest);
    const value = m ? expand(m[2], env, args) : null;
    return m && value !== null ? [[m[1], value]] : null;
  }
  const out: [string, string][] = [];
  const re = /\s*([A-Za-z_][A-Za-z0-9_]*)=(?:"([^"]*)"|'([^']*)'|([^\s"']*))(?=\s|$)/y;
  let at = 0;
  while (at < rest.length) {
    re.lastIndex = at;
    const m = re.exec(rest);
    if (!m) return null;
    const value = m[3] !== undefined ? m[3] : expand(m[2] ?? m[4] ?? "", env, args); // '…' is literal, as in Docker
    if (value === null) return null;
    out.push([m[1], value]);
    at = re.lastIndex;
    while (rest[at] === " " || rest[at] === "\t") at++;
  }
  return out.length ? out : null;
}

let argKey: { dir: string; key: Promise<Buffer> } | undefined;

/** The server's key for build-arg HMACs: 32 random bytes in `<dir>/arg-key` (0600), made on first use. */
export function argKeyIn(dir: string): Promise<Buffer> {
  if (argKey?.dir !== dir) {
    const file = join(dir, "arg-key");
    const key = readFile(file).catch(async () => {
      await mkdir(dir, { recursive: true, mode: 0o711 });
      const fresh = randomBytes(32);
      await writeFile(file, fresh, { mode: 0o600, flag: "wx" }).catch(() => undefined);
      return readFile(file); // whoever wrote first, everyone uses that key
    });
    argKey = { dir, key };
  }
  return argKey.key;
}

/** A build arg's value as a cache-key input: an HMAC under the server's key, so a key in the store reveals no value. */
export function argDigest(hmacKey: Buffer, name: string, value: string): string {
  return `arg ${name} ${createHmac("sha256", hmacKey).update(`${name}\0${value}`).digest("hex")}`;
}

/**
 * The plan, or why the Dockerfile goes to the builder instead. `buildArgs` are the request's; an ARG without one
 * uses its default.
 */
export function planDockerfile(text: string, o: { buildArgs?: Record<string, string>; target?: string; secrets?: unknown[]; argKey: Buffer; baseEnv?: Record<string, string> }): DockerfilePlan | { builder: string } {
  if ((o.secrets ?? []).length) return { builder: "it uses secrets" };
  if (/^\s*#\s*(escape|syntax|check)\s*=/im.test(text.split(/\r?\n/).slice(0, 5).join("\n"))) return { builder: "it has a parser directive" };
  const lines = logicalLines(text);
  const steps: PlannedStep[] = [];
  let from: string | undefined;
  let setsUser = false;
  let workdir = "/";
  const args = new Map<string, string | undefined>();
  const env = new Map(Object.entries(o.baseEnv ?? {}));
  const clip = (s: string) => (s.length > 80 ? s.slice(0, 77) + "…" : s);
  for (const { text: l, line } of lines) {
    const m = /^(\S+)\s*([\s\S]*)$/.exec(l)!;
    const op = m[1].toUpperCase();
    const rest = m[2].trim();
    const why = (what: string) => ({ builder: `line ${line}: ${what}` });
    if (op === "FROM") {
      if (from !== undefined) return why("it has several stages");
      const words = rest.split(/\s+/);
      if (words.some((w) => w.startsWith("--")) || VAR.test(rest)) return why("FROM has flags or variables");
      if (words.length === 3 && words[1].toUpperCase() === "AS") {
        if (o.target && o.target.toLowerCase() !== words[2].toLowerCase()) return why("the target is another stage");
      } else if (words.length !== 1) return why("FROM is not `FROM image [AS name]`");
      else if (o.target) return why("the target names a stage this Dockerfile lacks");
      from = words[0];
      continue;
    }
    if (from === undefined) return why(`${op} before FROM`);
    // The build args in scope, as RUN sees them (environment) and as the cache key sees them (HMACs only).
    const scope = [...args].filter((a): a is [string, string] => a[1] !== undefined);
    const keyArgs = scope.map(([k, v]) => argDigest(o.argKey, k, v));
    let instructions: Instruction[];
    let keyInputs: string[] = [];
    let description = clip(`${op} ${rest}`.replace(/[\x00-\x1f]/g, " "));
    switch (op) {
      case "RUN": {
        if (rest.startsWith("--")) return why("RUN has flags");
        if (/<<-?\s*["']?[A-Za-z_]/.test(rest)) return why("RUN has a heredoc");
        let script = rest;
        if (rest.startsWith("[")) {
          let argv: unknown;
          try {
            argv = JSON.parse(rest);
          } catch {
            argv = undefined;
          }
          // Docker runs a RUN that is not valid JSON as shell form, the brackets and all.
          if (Array.isArray(argv) && argv.length && argv.every((a) => typeof a === "string")) script = `exec ${(argv as string[]).map(shellQuote).join(" ")}`;
        }
        instructions = [{ op: "RUN", script, envs: scope }];
        keyInputs = keyArgs;
        break;
      }
      case "ENV": {
        const envs = parseEnv(rest, env, args);
        if (!envs) return why("ENV uses variables, escapes or a form other than K=V");
        for (const [k, v] of envs) env.set(k, v); // and hides an ARG of the same name
        keyInputs = keyArgs; // a value may come from an arg
        instructions = [{ op: "ENV", envs }];
        description = `ENV ${envs.map(([k]) => k).join(" ")}`;
        break;
      }
      case "WORKDIR": {
        const path = expand(rest, env, args);
        if (path === null || !path || /\s/.test(path)) return why("WORKDIR uses a variable form other than $X/${X}, or spaces");
        workdir = posix.resolve(workdir, path);
        instructions = [{ op: "WORKDIR", path }];
        keyInputs = keyArgs;
        break;
      }
      case "USER":
        // A name, resolved in the machine's /etc/passwd; a bare id (which Docker takes even without an entry) and a
        // group are the builder's.
        if (VAR.test(rest) || !/^[A-Za-z_][A-Za-z0-9_.-]*$/.test(rest)) return why("USER is not a plain user name");
        setsUser = true;
        instructions = [{ op: "USER", user: rest }];
        break;
      case "COPY": {
        if (VAR.test(rest)) return why("COPY uses variables");
        let words: string[];
        if (rest.replace(/^(--\S+\s+)*/, "").startsWith("[")) return why("COPY in JSON form");
        words = rest.split(/\s+/);
        let owner: string | undefined;
        let mode: string | undefined;
        while (words[0]?.startsWith("--")) {
          const f = /^--(chown|chmod)=(.+)$/.exec(words.shift()!);
          if (!f) return why("COPY has a flag other than --chown/--chmod");
          if (f[1] === "chown") {
            if (!/^[A-Za-z_][A-Za-z0-9_.-]*$/.test(f[2])) return why("COPY --chown is not a plain user name");
            owner = f[2];
          } else {
            if (!/^0?[0-7]{3,4}$/.test(f[2])) return why("COPY --chmod is not octal");
            mode = f[2].padStart(4, "0");
          }
        }
        if (words.length !== 2) return why("COPY has several sources");
        const [src, dest] = words;
        if (/[*?[\]]/.test(src) || src.startsWith("/") || src.split("/").includes("..")) return why("COPY source is a pattern or leaves the context");
        instructions = [{ op: "COPY", src, dest, mode, owner }];
        break;
      }
      case "ARG": {
        const a = /^([A-Za-z_][A-Za-z0-9_]*)(?:=(.*))?$/.exec(rest);
        if (!a || (a[2] !== undefined && (VAR.test(a[2]) || /["'\\\s]/.test(a[2])))) return why("ARG is not `ARG NAME[=plain default]`");
        args.set(a[1], o.buildArgs?.[a[1]] ?? a[2]);
        instructions = [];
        description = `ARG ${a[1]}`; // the default may be a value someone treats as secret: the log names only the arg
        break;
      }
      case "LABEL":
      case "EXPOSE":
        // Kiln machines keep neither: the step is recorded (and counted) and changes nothing.
        instructions = [];
        break;
      default:
        return why(`${op} is left to the builder`);
    }
    // Every instruction's key carries its own text; an ARG's carries the HMAC of the value it brings in.
    const own = op === "ARG" ? [argDigest(o.argKey, rest.split("=")[0], args.get(rest.split("=")[0]) ?? "\0unset")] : [];
    steps.push({ index: steps.length + 1, description, instructions, text: `${op} ${rest}`, transient: false, keyInputs: [...keyInputs, ...own] });
  }
  if (from === undefined) return { builder: "it has no FROM" };
  return { from, steps, setsUser };
}
