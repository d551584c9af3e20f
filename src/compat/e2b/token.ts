// envd access tokens: one per sandbox and API key, `<key id>.<HMAC-SHA256 of both under a secret kept in the data dir
// (0600)>`, so no token is ever stored, every server on the same data dir gives the same answer after a restart, and
// a token dies with the key it was issued to (the auth hook checks the key id it names).

import { createHash, createHmac, randomBytes, timingSafeEqual } from "node:crypto";
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

const KEY_ID = /^key_[0-9a-z]{1,64}$/;

export function createTokens(secret: Buffer) {
  const mac = (sandboxId: string, keyId: string) => createHmac("sha256", secret).update(`envd:${sandboxId}:${keyId}`).digest("base64url");
  /** The token a holder of key `keyId` uses for sandbox `sandboxId`. */
  const tokenOf = (sandboxId: string, keyId: string) => `${keyId}.${mac(sandboxId, keyId)}`;
  return {
    tokenOf,
    /** The key id a valid token for `sandboxId` was issued to; undefined for anything else (constant-time MAC check). */
    verify(sandboxId: string, presented: unknown): string | undefined {
      if (typeof presented !== "string") return undefined;
      const dot = presented.indexOf(".");
      const keyId = presented.slice(0, dot);
      if (dot < 0 || !KEY_ID.test(keyId)) return undefined;
      const want = Buffer.from(mac(sandboxId, keyId));
      const got = Buffer.from(presented.slice(dot + 1));
      return got.length === want.length && timingSafeEqual(got, want) ? keyId : undefined;
    },
  };
}

/**
 * envd's signature of a file URL (`downloadUrl`/`uploadUrl` with `secure: true`): `v1_` + unpadded base64 of
 * SHA-256 over `path:operation:user:token[:expiration]`, as the SDK computes it from the sandbox's access token.
 */
export function fileUrlSignature(token: string, path: string, operation: "read" | "write", user: string, expiration: number | undefined): string {
  const raw = expiration === undefined ? `${path}:${operation}:${user}:${token}` : `${path}:${operation}:${user}:${token}:${expiration}`;
  return "v1_" + createHash("sha256").update(raw).digest("base64").replace(/=+$/, "");
}

/** Same-length strings compared in constant time. */
export function sameText(a: string, b: string): boolean {
  const x = Buffer.from(a);
  const y = Buffer.from(b);
  return x.length === y.length && timingSafeEqual(x, y);
}
