// Server secrets of the deployments room, each a file of 32 random bytes (hex, mode 0600) in the data dir, made on
// first start and read on every start after: the edge-token key and the key that seals deployment envs at rest.

import { randomBytes } from "node:crypto";
import { mkdir, open, readFile } from "node:fs/promises";
import { join } from "node:path";

export async function loadKeyFile(dataDir: string, name: string): Promise<Buffer> {
  const path = join(dataDir, name);
  await mkdir(dataDir, { recursive: true });
  try {
    const fh = await open(path, "wx", 0o600);
    await fh.writeFile(randomBytes(32).toString("hex") + "\n");
    await fh.close();
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== "EEXIST") throw err;
  }
  const hex = (await readFile(path, "utf8")).trim();
  if (!/^[0-9a-f]{64}$/.test(hex)) throw new Error(`${path} is not a key file (64 hex characters)`);
  return Buffer.from(hex, "hex");
}
