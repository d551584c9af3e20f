// Server secrets of the deployments room, each a file of 32 random bytes (hex, mode 0600) in the data dir, made on
// first start and read on every start after: the edge-token key and the key that seals deployment envs at rest.

import { randomBytes } from "node:crypto";
import { mkdir, open, readFile, stat } from "node:fs/promises";
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

/**
 * A key file the operator made and named by configuration (`variable`): never made here, a regular file no one but
 * its owner may read or write (mode 0600 or 0400), 64 hex characters. Any other is refused at start, naming the
 * variable and the path (never the contents).
 */
export async function readKeyFile(path: string, variable: string): Promise<Buffer> {
  let st;
  try {
    st = await stat(path);
  } catch (err) {
    throw new Error(`${variable} names ${path}, which cannot be read (${(err as NodeJS.ErrnoException).code ?? "error"}); make it with: umask 077; openssl rand -hex 32 > ${path}`);
  }
  if (!st.isFile()) throw new Error(`${variable} names ${path}, which is not a regular file`);
  if ((st.mode & 0o077) !== 0) throw new Error(`${variable} names ${path}, which others may read or write (mode ${(st.mode & 0o777).toString(8)}); chmod 600 it`);
  const hex = (await readFile(path, "utf8")).trim();
  if (!/^[0-9a-f]{64}$/.test(hex)) throw new Error(`${variable} names ${path}, which is not a key file (64 hex characters)`);
  return Buffer.from(hex, "hex");
}
