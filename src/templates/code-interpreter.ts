// `local/code-interpreter-v1`, made by Kiln when first asked for (an E2B create naming it, the default template
// of `@e2b/code-interpreter`) or ahead of time (`kiln templates init-code-interpreter`): the base template plus a
// cached layer of Debian's numpy, pandas and matplotlib (src/builder/code-interpreter-template.ts). A template of
// that name the user built or recorded is used as it is; this only fills the name when nothing has it.

import { KilnError } from "../errors.ts";
import type { Logger } from "../log.ts";
import { CODE_INTERPRETER_TEMPLATE, cachedCodeInterpreterLayer, ensureCodeInterpreterLayer } from "../builder/code-interpreter-template.ts";
import { artifactConfig } from "../builder/artifact-config.ts";
import type { ArtifactConfig } from "../builder/artifact-config.ts";
import { BASE_TEMPLATE_REF, DEFAULT_NAMESPACE } from "./resolver.ts";
import type { ResolvedTemplate, TemplateService } from "./service.ts";

export const CODE_INTERPRETER_REF = `${DEFAULT_NAMESPACE}/${CODE_INTERPRETER_TEMPLATE}`;
/** After a failed making, creates say why for this long before the next one tries again. */
const RETRY_AFTER_FAILURE_MS = 60_000;
/** What the making records with the template: its pooled machines are handed out with the Python kernel started. */
const CODE_INTERPRETER_CONFIG: ArtifactConfig = { image: { env: {} }, prestartKernel: true };

/**
 * A template's artifact config, as machines are made from it. The one place the code interpreter's name still
 * decides anything: a code-interpreter-v1 recorded before its making set `prestartKernel` has no such setting (and
 * registerBuiltIn keeps that artifact while the cached layer is unchanged), so its name stands for the setting.
 */
export function templateConfig(t: ResolvedTemplate): ArtifactConfig {
  const config = artifactConfig(t.artifact);
  if (config.prestartKernel === undefined && t.template.canonical_ref === CODE_INTERPRETER_REF) return { ...config, prestartKernel: true };
  return config;
}

export interface CodeInterpreterTemplate {
  /** Records it at start when its layer is already in the cache (no making). */
  registerCached(): Promise<boolean>;
  /** Makes (once at a time) and records it; resolves when it is recorded. */
  make(onProgress?: (line: string) => void): Promise<ResolvedTemplate>;
  /**
   * For a create that found no such template: starts making it (unless under way, or failed a moment ago) and
   * returns the 503 (retryable) that create answers meanwhile.
   */
  notReady(): KilnError;
}

export function createCodeInterpreterTemplate(deps: { templates: TemplateService; cacheDir: string; log: Logger }): CodeInterpreterTemplate {
  const { templates, cacheDir, log } = deps;
  let making: Promise<ResolvedTemplate> | undefined;
  let failed: { message: string; at: number } | undefined;

  async function base() {
    const b = await templates.resolve(BASE_TEMPLATE_REF);
    return { layerDir: b.layers[0]!, digest: b.artifact.digest, layers: b.layers };
  }

  async function registerCached(): Promise<boolean> {
    const b = await base();
    const layer = await cachedCodeInterpreterLayer(cacheDir, b.digest);
    if (!layer) return false;
    await templates.registerBuiltIn(CODE_INTERPRETER_REF, [...b.layers, layer.layerDir], layer.digest, CODE_INTERPRETER_CONFIG);
    return true;
  }

  function make(onProgress?: (line: string) => void): Promise<ResolvedTemplate> {
    making ??= (async () => {
      const b = await base();
      const layer = await ensureCodeInterpreterLayer({ cacheDir, baseLayerDir: b.layerDir, baseDigest: b.digest, log, onProgress });
      const t = await templates.registerBuiltIn(CODE_INTERPRETER_REF, [...b.layers, layer.layerDir], layer.digest, CODE_INTERPRETER_CONFIG);
      log.info({ artifact_id: t.artifact.id, created: layer.created }, "the code-interpreter-v1 template is ready");
      failed = undefined;
      return t;
    })().finally(() => {
      making = undefined;
    });
    return making;
  }

  function notReady(): KilnError {
    const unavailable = (message: string) => new KilnError("unavailable", message, { detail: { code: "unavailable", message, retryable: true } });
    if (failed && !making && Date.now() - failed.at < RETRY_AFTER_FAILURE_MS) return unavailable(`making the ${CODE_INTERPRETER_TEMPLATE} template failed (${failed.message}); it is tried again on a create after a minute`);
    if (!making) {
      log.info("making the code-interpreter-v1 template (first use)");
      make().catch((err: unknown) => {
        // A KilnError's message is written for the caller; anything else (a host path in an fs error) stays in the log.
        failed = { message: err instanceof KilnError ? err.message.slice(0, 300) : "an internal error; the server log has it", at: Date.now() };
        log.error({ err }, "making the code-interpreter-v1 template failed");
      });
    }
    return unavailable(`the ${CODE_INTERPRETER_TEMPLATE} template (the base template with numpy, pandas and matplotlib) is being made on its first use, which takes a few minutes; try again (or make it ahead of time: kiln templates init-code-interpreter)`);
  }

  return { registerCached, make, notReady };
}
