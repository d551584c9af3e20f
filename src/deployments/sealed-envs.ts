// Deployment envs at rest: sealed with AES-256-GCM under a key kept in the data dir, so the store (and a copy of
// it) never holds their values; only the server that made them can open them to start a replica.

import { createCipheriv, createDecipheriv, randomBytes } from "node:crypto";
import { loadKeyFile } from "./key-files.ts";

export const ENVS_KEY_FILE = "deployment-envs-key";

export interface EnvSealer {
  seal(envs: Record<string, string>): string;
  open(sealed: string): Record<string, string>;
}

export async function loadEnvSealer(dataDir: string): Promise<EnvSealer> {
  const key = await loadKeyFile(dataDir, ENVS_KEY_FILE);
  return {
    /** `v1.<iv>.<tag>.<ciphertext>`, base64url parts. */
    seal(envs) {
      const iv = randomBytes(12);
      const cipher = createCipheriv("aes-256-gcm", key, iv);
      const body = Buffer.concat([cipher.update(JSON.stringify(envs), "utf8"), cipher.final()]);
      return ["v1", iv.toString("base64url"), cipher.getAuthTag().toString("base64url"), body.toString("base64url")].join(".");
    },
    open(sealed) {
      const [v, iv, tag, body] = sealed.split(".");
      if (v !== "v1" || !iv || !tag || body === undefined) throw new Error("not sealed deployment envs");
      const decipher = createDecipheriv("aes-256-gcm", key, Buffer.from(iv, "base64url"));
      decipher.setAuthTag(Buffer.from(tag, "base64url"));
      return JSON.parse(Buffer.concat([decipher.update(Buffer.from(body, "base64url")), decipher.final()]).toString("utf8")) as Record<string, string>;
    },
  };
}
