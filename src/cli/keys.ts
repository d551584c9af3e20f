// `kiln keys create|list|revoke`: manage API keys in the local store (works whether or not the server runs).

import { Option } from "commander";
import type { Command } from "commander";
import { createKeyService, generateKeyIn, KEY_FORMATS } from "../keys/service.ts";
import type { KeyFormat } from "../keys/service.ts";
import { openStore } from "../store/db.ts";
import { loadConfigOrExit } from "./client.ts";

async function withKeys<T>(fn: (keys: ReturnType<typeof createKeyService>) => Promise<T>): Promise<T> {
  const config = loadConfigOrExit();
  const store = await openStore({ databaseUrl: config.databaseUrl, dataDir: config.dataDir });
  try {
    return await fn(createKeyService(store.db));
  } finally {
    await store.close();
  }
}

export function keyCommands(program: Command) {
  const keys = program.command("keys").description("Manage API keys in the local store ($KILN_DATA_DIR or KILN_DATABASE_URL)");
  keys
    .command("create")
    .description("Create a key and print it once")
    .option("--name <name>", "a name to tell keys apart", "cli")
    .addOption(new Option("--format <format>", "key shape; e2b makes e2b_<hex>, which the E2B SDK's key check accepts").choices(KEY_FORMATS).default("kiln"))
    .action((opts: { name: string; format: string }) =>
      withKeys(async (k) => {
        const made = await k.create(opts.name, generateKeyIn(opts.format as KeyFormat));
        process.stderr.write(`created ${made.id} (${made.name}); this is the only time the key is shown:\n`);
        process.stdout.write(made.key + "\n");
      }),
    );
  keys
    .command("list")
    .alias("ls")
    .description("List keys (prefixes only)")
    .action(() =>
      withKeys(async (k) => {
        for (const row of await k.list()) {
          process.stdout.write(`${row.id}\t${row.prefix}…\t${row.name}\t${row.revoked_at ? "revoked " + row.revoked_at : "active"}\tcreated ${row.created_at}\n`);
        }
      }),
    );
  keys
    .command("revoke <id>")
    .description("Revoke a key; requests with it are refused at once")
    .action((id: string) =>
      withKeys(async (k) => {
        const row = await k.revoke(id);
        process.stdout.write(`revoked ${row.id} at ${row.revoked_at}\n`);
      }),
    );
}
