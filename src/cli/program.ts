// The `kiln` command tree: `kiln serve` runs the server; `kiln keys …` and `kiln templates init-base` work on the local
// data dir directly; `kiln machines …` talk to a running server over the HTTP API. Building the tree loads no
// command's heavy parts (those load in their actions), so `--help` and every remote command start fast.

import { Command, Option } from "commander";
import { CONFIG_VARS } from "../config.ts";
import { loadConfigOrExit } from "./client.ts";
import { createLogger } from "../log.ts";
import { machineCommands } from "./machines.ts";
import { keyCommands } from "./keys.ts";
import { templateCommands } from "./templates.ts";
import { webhookCommands } from "./webhooks.ts";
import { codeCommands } from "./code.ts";
import { gitCommands } from "./git.ts";
import { volumeCommands } from "./volumes.ts";
import { deploymentCommands } from "./deployments.ts";
import { mcpCommand } from "./mcp.ts";

export function kilnProgram(): Command {
  const program = new Command("kiln")
    .description("Kiln: isolated Linux machines for AI agents, self-hosted")
    .version("0.1.0")
    .showHelpAfterError();

  withServerFlags(program.command("serve").description("Run the Kiln server (makes the base template on first start)")).action(async (opts) => {
    applyServerFlags(opts);
    const config = loadConfigOrExit();
    const log = createLogger({ level: config.logLevel });
    const { startKiln } = await import("../app.ts");
    const kiln = await startKiln(config, { log });
    log.info({ url: kiln.url, data_dir: config.dataDir, store: kiln.services.store.dialect, runtime: config.ociRuntime }, "kiln is serving");
    let stopping = false;
    const stop = (signal: string) => {
      if (stopping) return;
      stopping = true;
      log.info({ signal }, "shutting down: finishing in-flight requests");
      kiln.close().then(
        () => process.exit(0),
        (err: unknown) => {
          log.error({ err }, "shutdown failed");
          process.exit(1);
        },
      );
    };
    process.on("SIGTERM", () => stop("SIGTERM"));
    process.on("SIGINT", () => stop("SIGINT"));
  });

  keyCommands(program);
  templateCommands(program);
  machineCommands(program);
  webhookCommands(program);
  codeCommands(program);
  gitCommands(program);
  volumeCommands(program);
  deploymentCommands(program);
  mcpCommand(program);
  return program;
}

/** Flags that mirror KILN_* variables: a flag given on the command line wins over the environment. */
function withServerFlags(cmd: Command): Command {
  for (const [name, def, help] of CONFIG_VARS) {
    const flag = "--" + name.slice("KILN_".length).toLowerCase().replaceAll("_", "-");
    cmd.addOption(new Option(`${flag} <value>`, `${help} (env ${name}, default ${def})`));
  }
  return cmd;
}

function applyServerFlags(opts: Record<string, string | undefined>) {
  for (const [name] of CONFIG_VARS) {
    const key = name
      .slice("KILN_".length)
      .toLowerCase()
      .replace(/_([a-z])/g, (_m, c: string) => c.toUpperCase());
    if (opts[key] !== undefined) process.env[name] = opts[key];
  }
}
