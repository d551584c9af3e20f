// envd access tokens: one per sandbox and API key, `<key id>.<HMAC-SHA256 of both under a secret kept in the store>`,
// so no token is ever stored, every server of the store (one host or many) gives and checks the same tokens across
// restarts, and a token dies with the key it was issued to (the auth hook checks the key id it names).

import { createHash, createHmac, timingSafeEqual } from "node:crypto";
import { readFile } from "node:fs/promises";
import { join } from "node:path";
import type { Db } from "../../store/schema.ts";
import { storedSecret } from "../../store/secrets.ts";

/** Where a server kept the secret before it moved to the store: read once, so tokens already issued stay good. */
const LEGACY_SECRET_FILE = "e2b-envd-secret";
const SECRET_NAME = "e2b-envd";

async function legacySecret(dataDir: string): Promise<Buffer | undefined> {
  try {
    const hex = (await readFile(join(dataDir, LEGACY_SECRET_FILE), "utf8")).trim();
    return /^[0-9a-f]{64}$/.test(hex) ? Buffer.from(hex, "hex") : undefined;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== "ENOENT") throw err;
    return undefined;
  }
}

/**
 * The tokens' secret, shared by every server of the store (in `cluster_secrets`, beside the forwarding secret): the
 * first server to need it writes it — the one its data dir kept, if any — and every other reads that one.
 */
export function loadTokenSecret(db: Db, dataDir: string): Promise<Buffer> {
  return storedSecret(db, SECRET_NAME, () => legacySecret(dataDir));
}

const KEY_ID = /^key_[0-9a-z]{1,64}$/;

/**
 * The same scheme scopes two kinds of token: `envd` (a sandbox's access token, over its machine id) and `volume`
 * (E2B's per-volume token for the volume content API, over the `vol_` id). The purpose is hashed in, so a token of
 * one kind is never good for the other.
 */
export function createTokens(secret: Buffer) {
  const mac = (purpose: "envd" | "volume", id: string, keyId: string) => createHmac("sha256", secret).update(`${purpose}:${id}:${keyId}`).digest("base64url");
  const verifyAs = (purpose: "envd" | "volume", id: string, presented: unknown): string | undefined => {
    if (typeof presented !== "string") return undefined;
    const dot = presented.indexOf(".");
    const keyId = presented.slice(0, dot);
    if (dot < 0 || !KEY_ID.test(keyId)) return undefined;
    const want = Buffer.from(mac(purpose, id, keyId));
    const got = Buffer.from(presented.slice(dot + 1));
    return got.length === want.length && timingSafeEqual(got, want) ? keyId : undefined;
  };
  return {
    /** The token a holder of key `keyId` uses for sandbox `sandboxId`. */
    tokenOf: (sandboxId: string, keyId: string) => `${keyId}.${mac("envd", sandboxId, keyId)}`,
    /** The key id a valid token for `sandboxId` was issued to; undefined for anything else (constant-time MAC check). */
    verify: (sandboxId: string, presented: unknown) => verifyAs("envd", sandboxId, presented),
    /** The volume token a holder of key `keyId` gets for volume `volumeId` (E2B's `Volume.token`). */
    volumeTokenOf: (volumeId: string, keyId: string) => `${keyId}.${mac("volume", volumeId, keyId)}`,
    verifyVolume: (volumeId: string, presented: unknown) => verifyAs("volume", volumeId, presented),
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
