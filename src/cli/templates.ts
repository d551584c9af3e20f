// `kiln templates build|ls|get|builds|aliases|rm|init-base`: building templates with a live log and progress line,
// and inspecting them, over the HTTP API (init-base works on the local cache directly).

import type { Command } from "commander";
import { createHash } from "node:crypto";
import { readFileSync, readdirSync, statSync } from "node:fs";
import { join, relative } from "node:path";
import { request } from "undici";
import { ensureBaseTemplate } from "../builder/base-template.ts";
import { createTemplateService } from "../templates/service.ts";
import { createLogger } from "../log.ts";
import { openStoreFor } from "../app.ts";
import { apiClient, fail, loadConfigOrExit } from "./client.ts";
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
  run?: string[];
  apt?: string[];
  pip?: string[];
  env?: string[];
  buildEnv?: string[];
  workdir?: string;
  context?: string;
  copy?: string[];
  startCmd?: string;
  readyCmd?: string;
  skipCache?: boolean;
  json?: boolean;
}

export function templateCommands(program: Command) {
  const templates = program.command("templates").alias("t").description("Templates machines are made from");

  templates
    .command("build")
    .description("Build a template from a JSON request (-f) and/or flags; streams the build log live, exits non-zero on failure")
    .option("-f, --file <path>", "build request JSON (DESIGN.md field names); flags below add to it")
    .option("-n, --name <name>", "template name")
    .option("--alias <alias>", "read-only alias of the template")
    .option("--tag <tag>", "tag for the artifact (repeatable; default: default)", collect)
    .option("--base-image <ref>", "a Kiln template (local/x, local/x:tag, art_…) to build FROM")
    .option("--env <KEY=VALUE>", "env step: baked into the template (repeatable)", collect)
    .option("--workdir <path>", "workdir step")
    .option("--apt <package>", "apt_install step (repeatable, one step)", collect)
    .option("--pip <package>", "pip_install step (repeatable, one step)", collect)
    .option("--run <command>", "run step (repeatable, in order, after the steps above)", collect)
    .option("--context <dir>", "upload every file under dir as the build context")
    .option("--copy <src:dest>", "copy step from the context (repeatable)", collect)
    .option("--build-env <KEY=VALUE>", "visible to build steps only, never baked in (repeatable)", collect)
    .option("--start-cmd <cmd>", "started in every machine made from the template")
    .option("--ready-cmd <cmd>", "decides when start-cmd is up (default: alive for 1 s)")
    .option("--skip-cache", "bypass every cache tier")
    .option("--json", "print each log entry as a JSON line")
    .action(async (opts: BuildOpts) => {
      const client = apiClient();
      const body: Record<string, any> = opts.file ? JSON.parse(readFileSync(opts.file === "-" ? 0 : opts.file, "utf8")) : {};
      const steps: unknown[] = body.steps ?? [];
      if (opts.env) steps.push({ type: "env", envs: kv(opts.env) });
      if (opts.workdir) steps.push({ type: "workdir", path: opts.workdir });
      if (opts.apt) steps.push({ type: "apt_install", packages: opts.apt });
      if (opts.pip) steps.push({ type: "pip_install", packages: opts.pip });
      for (const c of opts.copy ?? []) {
        const i = c.indexOf(":");
        if (i < 1) fail(`--copy wants src:dest, not ${JSON.stringify(c)}`);
        steps.push({ type: "copy", src: c.slice(0, i), dest: c.slice(i + 1) });
      }
      for (const command of opts.run ?? []) steps.push({ type: "run", command });
      if (steps.length) body.steps = steps;
      if (opts.name) body.name = opts.name;
      if (opts.alias) body.alias = opts.alias;
      if (opts.tag) body.tags = opts.tag;
      if (opts.baseImage) body.base_image = opts.baseImage;
      if (opts.buildEnv) body.build_envs = { ...body.build_envs, ...kv(opts.buildEnv) };
      if (opts.startCmd) body.start_cmd = opts.startCmd;
      if (opts.readyCmd) body.ready_cmd = opts.readyCmd;
      if (opts.skipCache) body.skip_cache = true;
      if (opts.context) {
        const files = [];
        for (const path of walk(opts.context)) {
          const bytes = readFileSync(join(opts.context, path));
          const sha = createHash("sha256").update(bytes).digest("hex");
          const head = await request(`${client.baseUrl}/v1/templates/blobs/${sha}`, { method: "HEAD", headers: { authorization: `Bearer ${client.key}` } });
          await head.body.dump();
          if (head.statusCode !== 200) {
            const put = await request(`${client.baseUrl}/v1/templates/blobs/${sha}`, { method: "PUT", headers: { authorization: `Bearer ${client.key}`, "content-type": "application/octet-stream" }, body: bytes });
            if (put.statusCode >= 300) fail(`uploading ${path} failed: ${await put.body.text()}`);
            await put.body.dump();
          }
          const mode = (statSync(join(opts.context, path)).mode & 0o777).toString(8).padStart(4, "0");
          files.push({ path, sha256: sha, mode });
        }
        body.context = { files: [...(body.context?.files ?? []), ...files] };
      }
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
      if (last?.kind === "error") fail(`build ${last.build_id} failed in phase ${last.error_detail?.phase ?? last.phase ?? "?"}${last.error_detail?.step_index ? ` at step ${last.error_detail.step_index}` : ""}: ${last.message}`);
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
    .action(async () => {
      const config = loadConfigOrExit();
      const log = createLogger({ level: "warn" });
      const started = Date.now();
      const base = await ensureBaseTemplate({
        cacheDir: config.cacheDir,
        mirror: config.debianMirror,
        log,
        onProgress: (line) => process.stderr.write(`[${((Date.now() - started) / 1000).toFixed(1)}s] ${line}\n`),
      });
      const store = await openStoreFor(config);
      try {
        const t = await createTemplateService(store.db).registerBase(base.layerDir, base.digest);
        process.stdout.write(`${t.template.canonical_ref} ${t.artifact.id} ${base.created ? "made" : "cached"} in ${((Date.now() - started) / 1000).toFixed(1)} s at ${base.layerDir}\n`);
      } finally {
        await store.close();
      }
    });
}
