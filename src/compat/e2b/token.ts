// envd access tokens: one per sandbox, HMAC-SHA256 of its id under a secret kept in the data dir (0600), so no
// token is ever stored and every server on the same data dir gives the same answer after a restart.

import { createHmac, randomBytes, timingSafeEqual } from "node:crypto";
import { chmod, mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";

const SECRET_FILE = "e2b-envd-secret";

export async function loadTokenSecret(dataDir: string): Promise<Buffer> {
  const file = join(dataDir, SECRET_FILE);
  try {
    const hex = (await readFile(file, "utf8")).trim();
    if (/^[0-9a-f]{64}$/.test(hex)) return Buffer.from(hex, "hex");
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== "ENOENT") throw err;
  }
  const secret = randomBytes(32);
  await mkdir(dataDir, { recursive: true });
  // wx: two servers starting at once keep whichever wrote first.
  await writeFile(file, secret.toString("hex") + "\n", { mode: 0o600, flag: "wx" }).catch(async (err: NodeJS.ErrnoException) => {
    if (err.code !== "EEXIST") throw err;
  });
  await chmod(file, 0o600);
  return Buffer.from((await readFile(file, "utf8")).trim(), "hex");
}

export function createTokens(secret: Buffer) {
  const tokenOf = (sandboxId: string) => createHmac("sha256", secret).update(`envd:${sandboxId}`).digest("base64url");
  return {
    tokenOf,
    verify(sandboxId: string, presented: unknown): boolean {
      if (typeof presented !== "string") return false;
      const want = Buffer.from(tokenOf(sandboxId));
      const got = Buffer.from(presented);
      return got.length === want.length && timingSafeEqual(got, want);
    },
  };
}
