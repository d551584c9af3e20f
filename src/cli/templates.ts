// `kiln templates init-base`: makes (or finds cached) the base template with live progress, and records it.

import type { Command } from "commander";
import { ensureBaseTemplate } from "../builder/base-template.ts";
import { createTemplateService } from "../services/templates.ts";
import { createLogger } from "../log.ts";
import { openStoreFor } from "../app.ts";
import { loadConfigOrExit } from "./client.ts";

export function templateCommands(program: Command) {
  const templates = program.command("templates").description("Templates machines are made from");
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
