// An image's config (Env, WorkingDir, Entrypoint, Cmd, User) turned into Kiln's ImageConfig, with `User` in any
// of its six forms resolved to numeric ids against the image's own /etc/passwd and /etc/group.

import type { ImageConfig } from "./types.ts";
import { importError } from "./types.ts";

export interface OciImageConfig {
  architecture?: string;
  os?: string;
  "os.version"?: string;
  "os.features"?: string[];
  config?: { Env?: string[]; WorkingDir?: string; User?: string; Entrypoint?: string[] | null; Cmd?: string[] | null };
  rootfs?: { type?: string; diff_ids?: string[] };
}

interface Account {
  name: string;
  id: number;
  gid?: number;
}

/** Lines of a passwd or group file: name:x:id[:gid…]. */
export function parseAccounts(text: string | undefined, kind: "passwd" | "group"): Account[] {
  if (!text) return [];
  const out: Account[] = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const f = line.split(":");
    const id = Number(f[2]);
    if (!f[0] || !Number.isInteger(id)) continue;
    out.push({ name: f[0], id, gid: kind === "passwd" && Number.isInteger(Number(f[3])) && f[3] !== "" ? Number(f[3]) : undefined });
  }
  return out;
}

const NUMERIC = /^\d+$/;

/**
 * `user`, `uid`, `user:group`, `user:gid`, `uid:group`, `uid:gid` → numeric ids. A name must exist in the image; a
 * numeric uid need not (its group is then the passwd entry's, or 0, as container runtimes do).
 */
export function resolveUser(user: string, passwd: string | undefined, group: string | undefined): { uid: number; gid: number } {
  const [u, g, extra] = user.split(":");
  if (extra !== undefined || !u) throw importError(`the image's User ${JSON.stringify(user)} is not of the form user[:group]`);
  const users = parseAccounts(passwd, "passwd");
  let uid: number;
  let primary: number | undefined;
  if (NUMERIC.test(u)) {
    uid = Number(u);
    primary = users.find((a) => a.id === uid)?.gid;
  } else {
    const entry = users.find((a) => a.name === u);
    if (!entry) throw importError(`the image's User ${JSON.stringify(user)} names user ${JSON.stringify(u)}, which the image's /etc/passwd does not have`);
    uid = entry.id;
    primary = entry.gid;
  }
  let gid: number;
  if (g === undefined || g === "") gid = primary ?? 0;
  else if (NUMERIC.test(g)) gid = Number(g);
  else {
    const entry = parseAccounts(group, "group").find((a) => a.name === g);
    if (!entry) throw importError(`the image's User ${JSON.stringify(user)} names group ${JSON.stringify(g)}, which the image's /etc/group does not have`);
    gid = entry.id;
  }
  if (uid > 65_535 || gid > 65_535) throw importError(`the image's User ${JSON.stringify(user)} is outside the machines' id range (0–65535)`);
  return { uid, gid };
}

/** Env as a map (later entries win), the rest copied as recorded; User left for the caller to resolve. */
export function imageConfigOf(config: OciImageConfig): Omit<ImageConfig, "user"> & { rawUser?: string } {
  const c = config.config ?? {};
  const env: Record<string, string> = {};
  for (const kv of c.Env ?? []) {
    const i = kv.indexOf("=");
    if (i > 0) env[kv.slice(0, i)] = kv.slice(i + 1);
  }
  return {
    env,
    // An image without WorkingDir runs in `/`, as container runtimes run it (Kiln's /workspace is its base's).
    workingDir: c.WorkingDir || "/",
    ...(c.Entrypoint?.length ? { entrypoint: c.Entrypoint } : {}),
    ...(c.Cmd?.length ? { cmd: c.Cmd } : {}),
    ...(c.User ? { rawUser: c.User } : {}),
  };
}
