// The id of the host a server's machines run on: made once per data dir (`$KILN_DATA_DIR/host-id`) or given by
// KILN_HOST_ID, so several servers on one store each reconcile only the machines their own runtime runs.

import { randomBytes } from "node:crypto";
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";

export async function ensureHostId(dataDir: string, configured?: string): Promise<string> {
  if (configured) return configured;
  const file = join(dataDir, "host-id");
  try {
    const existing = (await readFile(file, "utf8")).trim();
    if (existing) return existing;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== "ENOENT") throw err;
  }
  await mkdir(dataDir, { recursive: true });
  const id = `host_${randomBytes(10).toString("hex")}`;
  // "wx": two servers racing on one data dir keep the first id; the loser reads it.
  try {
    await writeFile(file, id + "\n", { flag: "wx", mode: 0o644 });
    return id;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "EEXIST") return (await readFile(file, "utf8")).trim();
    throw err;
  }
}
