// Registry credentials: the three `base_image_auth` variants turned into what a registry asks for, and the
// `WWW-Authenticate` challenge answered (Basic, or a bearer token fetched from the realm with the pull scope).

import { sameRegistry, DOCKER_HUB } from "./reference.ts";
import { importError } from "./types.ts";

export type BaseImageAuth =
  | { type: "basic"; username: string; password: string }
  | { type: "token"; token: string }
  | { type: "docker_config"; config: string | Record<string, unknown> };

/** What credentials come to for one registry host. */
export type RegistryCredential = { kind: "basic"; username: string; password: string } | { kind: "bearer"; token: string } | undefined;

/** The credential for `registry` out of a `base_image_auth`; a docker config without that host gives none. */
export function credentialFor(auth: BaseImageAuth | undefined, registry: string): RegistryCredential {
  if (!auth) return undefined;
  if (auth.type === "basic") return { kind: "basic", username: auth.username, password: auth.password };
  if (auth.type === "token") return { kind: "bearer", token: auth.token };
  let config: unknown = auth.config;
  if (typeof config === "string") {
    try {
      config = JSON.parse(config);
    } catch {
      throw importError("base_image_auth.config is not a docker config.json (not JSON)");
    }
  }
  const auths = (config as { auths?: Record<string, Record<string, string>> } | null)?.auths;
  if (!auths || typeof auths !== "object") throw importError("base_image_auth.config has no `auths` object");
  for (const [host, entry] of Object.entries(auths)) {
    const h = host === "https://index.docker.io/v1/" ? DOCKER_HUB : host;
    if (!sameRegistry(h, registry) || !entry || typeof entry !== "object") continue;
    if (entry.registrytoken) return { kind: "bearer", token: entry.registrytoken };
    if (entry.username && entry.password) return { kind: "basic", username: entry.username, password: entry.password };
    if (entry.auth) {
      const decoded = Buffer.from(entry.auth, "base64").toString();
      const i = decoded.indexOf(":");
      if (i > 0) return { kind: "basic", username: decoded.slice(0, i), password: decoded.slice(i + 1) };
    }
    throw importError(`base_image_auth.config has an entry for ${registry} without usable credentials`);
  }
  return undefined;
}

export function basicHeader(username: string, password: string): string {
  return `Basic ${Buffer.from(`${username}:${password}`).toString("base64")}`;
}

export interface Challenge {
  scheme: string;
  params: Record<string, string>;
}

/** Parses `Bearer realm="…",service="…",scope="…"` (quoted or bare values). */
export function parseChallenge(header: string | undefined): Challenge | undefined {
  if (!header) return undefined;
  const m = /^\s*(\w+)\s*(.*)$/s.exec(header);
  if (!m) return undefined;
  const params: Record<string, string> = {};
  for (const p of m[2].matchAll(/(\w+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,\s]*))/g)) params[p[1].toLowerCase()] = p[2] !== undefined ? p[2].replace(/\\(.)/g, "$1") : p[3];
  return { scheme: m[1].toLowerCase(), params };
}
