// `kiln templates build|ls|get|builds|aliases|rm|init-base|init-code-interpreter`: building templates with a live log and progress line,
// and inspecting them, over the HTTP API (init-base and init-code-interpreter work on the local cache directly).

import type { Command } from "commander";
import { createHash } from "node:crypto";
import { readFileSync, readdirSync, statSync } from "node:fs";
import { join, relative } from "node:path";
import { request } from "undici";
import { createLogger } from "../log.ts";
import { apiClient, fail, loadConfigOrExit } from "./client.ts";
import type { ApiClient } from "./client.ts";
import { createProgress } from "./build-progress.ts";
import type { LogEntry } from "../builder/log.ts";

const collect = (v: string, prev: string[] = []) => [...prev, v];

function kv(list: string[] | undefined): Record<string, string> | undefined {
  if (!list?.length) return undefined;
  return Object.fromEntries(list.map((s) => (s.includes("=") ? [s.slice(0, s.indexOf("=")), s.slice(s.indexOf("=") + 1)] : [s, ""])));
}

/** Every regular file under `dir`, relative paths with forward slashes. */
function walk(dir: string, root = dir): string[] {
  const out: string[] = [];
  for (const name of readdirSync(dir).sort()) {
    const p = join(dir, name);
    const st = statSync(p);
    if (st.isDirectory()) out.push(...walk(p, root));
    else if (st.isFile()) out.push(relative(root, p).split("\\").join("/"));
  }
  return out;
}

interface BuildOpts {
  file?: string;
  name?: string;
  alias?: string;
  tag?: string[];
  baseImage?: string;
  fromSnapshot?: string;
  dockerfile?: string;
  buildEnv?: string[];
  context?: string;
  startCmd?: string;
  readyCmd?: string;
  vcpus?: number;
  memory?: number;
  internet: boolean;
  skipCache?: boolean;
  json?: boolean;
  dryRun?: boolean;
}

/** `a<sep>b` split at the first separator, or a clear error naming the flag. */
function pair(flag: string, value: string, sep: string, shape: string): [string, string] {
  const i = value.indexOf(sep);
  if (i < 1 || i === value.length - 1) fail(`--${flag} takes ${shape}, not ${JSON.stringify(value)}`);
  return [value.slice(0, i), value.slice(i + 1)];
}

/** `url#fragment` → the URL a server sees and the fragment (never sent over the wire, so free to carry options). */
function fragment(url: string): [string, string | undefined] {
  const i = url.indexOf("#");
  return i < 0 ? [url, undefined] : [url.slice(0, i), url.slice(i + 1)];
}

/**
 * The flags that each add one declarative step (the 15 kinds; docs/builds.md lists their fields), in the
 * order they are given on the command line. Repeated --env, --apt, --pip and --npm in a row make one step.
 */
const STEP_FLAGS: { flags: string; help: string; step: (v: string, last: any) => Record<string, unknown> | null }[] = [
  { flags: "--run <command>", help: "run step: a shell line", step: (command) => ({ type: "run", command }) },
  { flags: "--env <KEY=VALUE>", help: "env step: baked into the template", step: (v, last) => merge(last, "env", "envs", kv([v])!) },
  { flags: "--workdir <path>", help: "workdir step", step: (path) => ({ type: "workdir", path }) },
  { flags: "--user <user>", help: "user step: later steps and machines run as this user", step: (user) => ({ type: "user", user }) },
  { flags: "--copy <src:dest>", help: "copy step from the --context", step: (v) => ((([src, dest]) => ({ type: "copy", src, dest }))(pair("copy", v, ":", "src:dest"))) },
  { flags: "--apt <package>", help: "apt_install step", step: (v, last) => merge(last, "apt_install", "packages", [v]) },
  { flags: "--pip <package>", help: "pip_install step", step: (v, last) => merge(last, "pip_install", "packages", [v]) },
  { flags: "--npm <package>", help: "npm_install step (in the working directory)", step: (v, last) => merge(last, "npm_install", "packages", [v]) },
  { flags: "--npm-global <package>", help: "npm_install step with global: true", step: (v) => ({ type: "npm_install", packages: [v], global: true }) },
  {
    flags: "--git-clone <dest=url[#branch]>",
    help: "git_clone step",
    step: (v) => {
      const [dest, rest] = pair("git-clone", v, "=", "dest=url[#branch]");
      const [url, branch] = fragment(rest);
      return { type: "git_clone", url, dest, ...(branch ? { branch } : {}) };
    },
  },
  {
    flags: "--download <dest=url[#sha256=hex]>",
    help: "download step (the digest is checked when given)",
    step: (v) => {
      const [dest, rest] = pair("download", v, "=", "dest=url[#sha256=hex]");
      const [url, frag] = fragment(rest);
      if (frag !== undefined && !frag.startsWith("sha256=")) fail(`--download takes url#sha256=<hex>, not #${frag}`);
      return { type: "download", url, dest, ...(frag ? { sha256: frag.slice("sha256=".length) } : {}) };
    },
  },
  {
    flags: "--write-file <path=content|path=@localfile>",
    help: "write_file step",
    step: (v) => {
      const [path, content] = pair("write-file", v, "=", "path=content or path=@localfile");
      return { type: "write_file", path, content: content.startsWith("@") ? readFileSync(content.slice(1), "utf8") : content };
    },
  },
  { flags: "--mkdir <path>", help: "mkdir step (parents too)", step: (path) => ({ type: "mkdir", path }) },
  { flags: "--remove <path>", help: "remove step (recursive, as rm -rf)", step: (path) => ({ type: "remove", path, recursive: true }) },
  { flags: "--rename <src:dest>", help: "rename step", step: (v) => ((([src, dest]) => ({ type: "rename", src, dest }))(pair("rename", v, ":", "src:dest"))) },
  { flags: "--symlink <path:target>", help: "symlink step: path becomes a link to target", step: (v) => ((([path, target]) => ({ type: "symlink", path, target }))(pair("symlink", v, ":", "path:target"))) },
];

/** Adds to the previous step when it is of the same kind (one env or package step for flags given in a row). */
function merge(last: any, type: string, field: string, value: Record<string, string> | string[]) {
  if (last?.type === type && !last.global) {
    last[field] = Array.isArray(value) ? [...last[field], ...value] : { ...last[field], ...value };
    return null;
  }
  return { type, [field]: value };
}

/** Puts a context file's bytes as a blob unless the server has it already. */
async function uploadBlob(client: ApiClient, sha: string, bytes: Buffer, path: string) {
  const head = await request(`${client.baseUrl}/v1/templates/blobs/${sha}`, { method: "HEAD", headers: { authorization: `Bearer ${client.key}` } });
  await head.body.dump();
  if (head.statusCode === 200) return;
  const put = await request(`${client.baseUrl}/v1/templates/blobs/${sha}`, { method: "PUT", headers: { authorization: `Bearer ${client.key}`, "content-type": "application/octet-stream" }, body: bytes });
  if (put.statusCode >= 300) fail(`uploading ${path} failed: ${await put.body.text()}`);
  await put.body.dump();
}

export function templateCommands(program: Command) {
  const templates = program.command("templates").alias("t").description("Templates machines are made from");

  const steps: Record<string, unknown>[] = [];
  const build = templates
    .command("build")
    .description("Build a template from a JSON request (-f), a Dockerfile and/or step flags (applied in the order given); streams the build log live, exits non-zero on failure")
    .option("-f, --file <path>", "build request JSON (fields in docs/builds.md; - for stdin); flags add to it")
    .option("-n, --name <name>", "template name")
    .option("--alias <alias>", "read-only alias of the template")
    .option("--tag <tag>", "tag for the artifact (repeatable; default: default)", collect)
    .option("--base-image <ref>", "a Kiln template (local/x, local/x:tag, art_…) or an OCI image to build FROM")
    .option("--from-snapshot <snp>", "build on a machine's snapshot: its files, over its template (processes are not kept)")
    .option("--dockerfile <path>", "build this Dockerfile (with --context as its build context)");
  for (const f of STEP_FLAGS) {
    build.option(f.flags, `${f.help} (repeatable)`);
    const name = f.flags.split(" ")[0]!.slice(2);
    build.on(`option:${name}`, (v: string) => {
      const step = f.step(v, steps.at(-1));
      if (step) steps.push(step);
    });
  }
  build
    .option("--context <dir>", "upload every file under dir as the build context")
    .option("--build-env <KEY=VALUE>", "visible to build steps only, never baked in (repeatable)", collect)
    .option("--start-cmd <cmd>", "started in every machine made from the template")
    .option("--ready-cmd <cmd>", "decides when start-cmd is up (default: alive for 1 s)")
    .option("--vcpus <n>", "vCPUs of the build machine", (v) => Number(v))
    .option("--memory <mb>", "memory (MiB) of the build machine", (v) => Number(v))
    .option("--no-internet", "build machine without outbound network")
    .option("--skip-cache", "bypass every cache tier")
    .option("--json", "print each log entry as a JSON line")
    .option("--dry-run", "print the build request as JSON (a file for -f) and send nothing")
    .action(async (opts: BuildOpts) => {
      const body: Record<string, any> = opts.file ? JSON.parse(readFileSync(opts.file === "-" ? 0 : opts.file, "utf8")) : {};
      if (steps.length) body.steps = [...(body.steps ?? []), ...steps];
      if (opts.name) body.name = opts.name;
      if (opts.alias) body.alias = opts.alias;
      if (opts.tag) body.tags = opts.tag;
      if (opts.baseImage) body.base_image = opts.baseImage;
      if (opts.fromSnapshot) body.from_snapshot = opts.fromSnapshot;
      if (opts.dockerfile) body.dockerfile = readFileSync(opts.dockerfile === "-" ? 0 : opts.dockerfile, "utf8");
      if (opts.buildEnv) body.build_envs = { ...body.build_envs, ...kv(opts.buildEnv) };
      if (opts.startCmd) body.start_cmd = opts.startCmd;
      if (opts.readyCmd) body.ready_cmd = opts.readyCmd;
      if (opts.vcpus !== undefined || opts.memory !== undefined || !opts.internet) {
        body.vm = { ...body.vm, ...(opts.vcpus !== undefined ? { vcpus: opts.vcpus } : {}), ...(opts.memory !== undefined ? { memory_mb: opts.memory } : {}), ...(!opts.internet ? { internet: false } : {}) };
      }
      if (opts.skipCache) body.skip_cache = true;
      // A dry run needs no server: context files are hashed, not uploaded.
      const client = opts.dryRun ? null : apiClient();
      if (opts.context) {
        const files = [];
        for (const path of walk(opts.context)) {
          const bytes = readFileSync(join(opts.context, path));
          const sha = createHash("sha256").update(bytes).digest("hex");
          if (client) await uploadBlob(client, sha, bytes, path);
          const mode = (statSync(join(opts.context, path)).mode & 0o777).toString(8).padStart(4, "0");
          files.push({ path, sha256: sha, mode });
        }
        body.context = { files: [...(body.context?.files ?? []), ...files] };
      }
      if (!client) return void process.stdout.write(JSON.stringify(body, null, 2) + "\n");
      const res = await request(`${client.baseUrl}/v1/templates/build`, {
        method: "POST",
        headers: { authorization: `Bearer ${client.key}`, "content-type": "application/json", accept: "text/event-stream" },
        body: JSON.stringify(body),
      }).catch((err: unknown) => fail(`cannot reach ${client.baseUrl}: ${(err as Error).message}`));
      if (res.statusCode !== 200) {
        const text = await res.body.text();
        let env: { code?: string; error?: string; request_id?: string } = {};
        try {
          env = JSON.parse(text);
        } catch {
          // not an envelope
        }
        fail(`${env.code ?? res.statusCode}: ${env.error ?? text} (request ${env.request_id ?? "?"})`);
      }
      const progress = createProgress(process.stderr, { json: opts.json === true });
      let buffer = "";
      let last: LogEntry | undefined;
      for await (const chunk of res.body) {
        buffer += chunk.toString();
        let cut: number;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (!data) continue;
          last = JSON.parse(data) as LogEntry;
          progress.entry(last);
        }
      }
      progress.done();
      if (last?.kind === "end") {
        const artifact = (last.metadata as { artifact_id?: string } | undefined)?.artifact_id;
        process.stdout.write(`${artifact ?? ""}\n`);
        return;
      }
      if (last?.kind === "error") {
        const d = last.error_detail;
        fail(`build ${last.build_id} failed in phase ${d?.phase ?? last.phase ?? "?"}${d?.step_index ? ` at step ${d.step_index}` : ""}: ${last.message}${d?.suggested_action ? `\n  what to do: ${d.suggested_action}` : ""}`);
      }
      fail(last?.kind === "cancelled" ? `build ${last.build_id} was cancelled` : "the build stream ended without a result");
    });

  templates
    .command("ls")
    .alias("list")
    .description("List templates with their tags")
    .action(async () => {
      const r = await apiClient().call<{ templates: { canonical_ref: string; template_id: string; tags: Record<string, string>; aliases: string[] }[] }>("GET", "/v1/templates");
      for (const t of r.templates) {
        const tags = Object.entries(t.tags).map(([tag, art]) => `${tag}=${art}`).join(" ");
        process.stdout.write(`${t.canonical_ref}\t${t.template_id}\t${tags || "-"}${t.aliases.length ? `\taliases ${t.aliases.join(",")}` : ""}\n`);
      }
    });

  templates
    .command("get <ref>")
    .description("Show a template as JSON")
    .action(async (ref: string) => {
      process.stdout.write(JSON.stringify(await apiClient().call("GET", `/v1/templates/${encodeURIComponent(ref)}`), null, 2) + "\n");
    });

  templates
    .command("builds <ref>")
    .description("Build history of a template, newest first")
    .option("--status <status>")
    .option("--limit <n>", "page size (1–100)", "20")
    .option("--json", "print the records")
    .action(async (ref: string, opts: { status?: string; limit: string; json?: boolean }) => {
      const q = new URLSearchParams({ limit: opts.limit });
      if (opts.status) q.set("status", opts.status);
      const r = await apiClient().call<{ builds: { build_id: string; status: string; tags: string[]; duration_ms: number | null; created_at: string; failure_phase: string | null; cache_summary: Record<string, number> }[] }>("GET", `/v1/templates/${encodeURIComponent(ref)}/builds?${q}`);
      if (opts.json) return void process.stdout.write(JSON.stringify(r.builds, null, 2) + "\n");
      for (const b of r.builds) {
        const cache = `hits ${b.cache_summary.layer_hits + b.cache_summary.final_artifact_hits}`;
        process.stdout.write(`${b.build_id}\t${b.status}${b.failure_phase ? `(${b.failure_phase})` : ""}\t${b.tags.join(",")}\t${b.duration_ms ?? "-"} ms\t${cache}\t${b.created_at}\n`);
      }
    });

  templates
    .command("aliases <ref>")
    .description("Read-only aliases of a template (ref as namespace/name)")
    .action(async (ref: string) => {
      const canonical = ref.includes("/") ? ref : `local/${ref}`;
      const r = await apiClient().call<{ alias_ref: string; created_at: string }[]>("GET", `/v1/templates/refs/${canonical}/aliases`);
      for (const a of r) process.stdout.write(`${a.alias_ref}\t${a.created_at}\n`);
    });

  templates
    .command("rm <ref>")
    .alias("delete")
    .description("Delete a template (refused while machines use it)")
    .action(async (ref: string) => {
      const t = await apiClient().call<{ canonical_ref: string }>("DELETE", `/v1/templates/${encodeURIComponent(ref)}`);
      process.stdout.write(`${t.canonical_ref} deleted\n`);
    });

  templates
    .command("init-base")
    .description("Make the base template (Debian bookworm minbase + python, git, curl) once and cache it")
    .action(() =>
      withLocalTemplates(async ({ base, templates, started }) => {
        const t = await templates.registerBase(base.layerDir, base.digest);
        return `${t.template.canonical_ref} ${t.artifact.id} ${base.created ? "made" : "cached"} in ${seconds(started)} s at ${base.layerDir}`;
      }),
    );

  templates
    .command("init-code-interpreter")
    .description("Make code-interpreter-v1 (the base template + numpy, pandas, matplotlib; E2B's default for @e2b/code-interpreter) once and cache it")
    .action(() =>
      withLocalTemplates(async ({ base, templates, started, log, onProgress, cacheDir }) => {
        const { createCodeInterpreterTemplate } = await import("../templates/code-interpreter.ts");
        await templates.registerBase(base.layerDir, base.digest);
        const t = await createCodeInterpreterTemplate({ templates, cacheDir, log }).make(onProgress);
        return `${t.template.canonical_ref} ${t.artifact.id} ready in ${seconds(started)} s at ${t.layers.at(-1)}`;
      }),
    );
}

const seconds = (since: number) => ((Date.now() - since) / 1000).toFixed(1);

/**
 * The local data dir's templates with the base template made (or found in the cache), for the `init-*` commands; prints
 * what `fn` answers. The builder and the store load only here, so that every other command starts fast.
 */
async function withLocalTemplates(
  fn: (ctx: {
    base: Awaited<ReturnType<typeof import("../builder/base-template.ts").ensureBaseTemplate>>;
    templates: ReturnType<typeof import("../templates/service.ts").createTemplateService>;
    started: number;
    log: ReturnType<typeof createLogger>;
    onProgress: (line: string) => void;
    cacheDir: string;
  }) => Promise<string>,
): Promise<void> {
  const config = loadConfigOrExit();
  const log = createLogger({ level: "warn" });
  const started = Date.now();
  const onProgress = (line: string) => process.stderr.write(`[${seconds(started)}s] ${line}\n`);
  const [{ ensureBaseTemplate }, { createTemplateService }, { openStore }] = await Promise.all([
    import("../builder/base-template.ts"),
    import("../templates/service.ts"),
    import("../store/db.ts"),
  ]);
  const base = await ensureBaseTemplate({ cacheDir: config.cacheDir, mirror: config.debianMirror, log, onProgress });
  const store = await openStore({ databaseUrl: config.databaseUrl, dataDir: config.dataDir });
  try {
    process.stdout.write((await fn({ base, templates: createTemplateService(store.db), started, log, onProgress, cacheDir: config.cacheDir })) + "\n");
  } finally {
    await store.close();
  }
}
