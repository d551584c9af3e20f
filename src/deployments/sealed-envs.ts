// Deployment envs at rest: sealed with AES-256-GCM under a key kept in the data dir (or, with
// KILN_DEPLOYMENT_ENVS_KEY_FILE, in a key file the operator gives every server of a store), so the store (and a copy
// of it) never holds their values; only a server holding the key can open them to start a replica.

import { createCipheriv, createDecipheriv, randomBytes } from "node:crypto";
import { loadKeyFile, readKeyFile } from "./key-files.ts";

export const ENVS_KEY_FILE = "deployment-envs-key";

export interface EnvSealer {
  seal(envs: Record<string, string>): string;
  open(sealed: string): Record<string, string>;
}

/**
 * `sharedKeyFile` (KILN_DEPLOYMENT_ENVS_KEY_FILE): seals with that key, so every server given the same file opens
 * what any of them sealed; what this server sealed before under its data dir's own key still opens with that one.
 */
export async function loadEnvSealer(dataDir: string, sharedKeyFile?: string): Promise<EnvSealer> {
  const own = await loadKeyFile(dataDir, ENVS_KEY_FILE);
  const keys = sharedKeyFile ? [await readKeyFile(sharedKeyFile, "KILN_DEPLOYMENT_ENVS_KEY_FILE"), own] : [own];
  const key = keys[0];
  const openWith = (k: Buffer, iv: string, tag: string, body: string) => {
    const decipher = createDecipheriv("aes-256-gcm", k, Buffer.from(iv, "base64url"));
    decipher.setAuthTag(Buffer.from(tag, "base64url"));
    return JSON.parse(Buffer.concat([decipher.update(Buffer.from(body, "base64url")), decipher.final()]).toString("utf8")) as Record<string, string>;
  };
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
      for (const k of keys.slice(0, -1)) {
        try {
          return openWith(k, iv, tag, body);
        } catch {
          // sealed under another key: the next one
        }
      }
      return openWith(keys[keys.length - 1], iv, tag, body);
    },
  };
}
