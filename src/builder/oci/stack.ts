// Reading the image a stack of layer dirs makes, as overlayfs will show it (whiteouts and opaque dirs honoured),
// and the small top layer every imported image gets: the mount points and /etc files a Kiln machine needs.

import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { chmod, lchown, mkdir, rename, rm, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { HOST_ID_BASE } from "../../runtime/oci/idmap.ts";
import { parseAccounts } from "./image-config.ts";
import { ConfinedRoot } from "./confined-root.ts";
import { importError } from "./types.ts";

/** /etc/passwd and /etc/group are read whole: an image's own are far smaller than this. */
const MAX_ACCOUNT_FILE = 4 << 20;

/**
 * The content of `path` (absolute, in the image) as the stacked `layers` (lowest first) show it, or undefined when
 * no layer has it or a higher layer deleted it. Each layer is read through a ConfinedRoot: only regular files are
 * read, and no symlink is followed, on the way or at the end (a symlink or file on the way hides what is below it,
 * as in overlayfs).
 */
export async function readFromStack(layers: string[], path: string): Promise<Buffer | undefined> {
  const parts = path.split("/").filter(Boolean);
  for (let i = layers.length - 1; i >= 0; i--) {
    const root = await ConfinedRoot.open(layers[i]);
    try {
      // A whiteout or an opaque directory on the way down hides everything below this layer.
      let hidden = false;
      for (let k = 1; k <= parts.length; k++) {
        const rel = parts.slice(0, k).join("/");
        const kind = await root.kind(rel);
        if (kind === "whiteout") return undefined;
        if (kind === undefined) break;
        if (k === parts.length) {
          if (kind !== "file") return undefined;
          const body = await root.readFile(rel, MAX_ACCOUNT_FILE).catch((err: Error) => {
            throw err instanceof RangeError ? importError(`the image's ${path} is larger than ${MAX_ACCOUNT_FILE} bytes`) : err;
          });
          return body;
        }
        if (kind !== "dir") return undefined;
        if ((await root.getXattr(rel, "trusted.overlay.opaque"))?.toString() === "y") hidden = true;
      }
      if (hidden) return undefined;
    } finally {
      await root.close();
    }
  }
  return undefined;
}

const TOP_LAYER_VERSION = "kiln-top-2";
export const ROOT_PASSWD = "root:x:0:0:root:/root:/bin/sh\n";
export const ROOT_GROUP = "root:x:0:\n";

/**
 * The layer Kiln puts on top of every imported image: empty mount points for what the machine binds at boot
 * (/etc/hosts, /etc/hostname, /etc/resolv.conf, /opt/kiln, /run/kiln, /dev, /proc, /sys, /tmp) and, only when the
 * image's lack what a machine needs, an /etc/passwd and /etc/group (see accountFiles). Keyed by what it holds, so
 * images share it.
 */
export async function ensureTopLayer(cacheDir: string, opts: { passwd?: string; group?: string }): Promise<{ dir: string; digest: string }> {
  const key = createHash("sha256").update(JSON.stringify([TOP_LAYER_VERSION, opts.passwd ?? null, opts.group ?? null])).digest("hex");
  const dir = join(cacheDir, "layers", `kiln-${key}`);
  const digest = `sha256:${key}`;
  if (existsSync(dir)) return { dir, digest };
  const tmp = `${dir}.tmp-${process.pid}-${Date.now()}`;
  await mkdir(tmp, { recursive: true });
  const owned = async (p: string, mode: number) => {
    await lchown(p, HOST_ID_BASE, HOST_ID_BASE);
    await chmod(p, mode);
  };
  for (const d of ["dev", "proc", "sys", "etc", "opt", "opt/kiln", "run", "run/kiln", "root"]) {
    await mkdir(join(tmp, d), { recursive: true });
    await owned(join(tmp, d), d === "root" ? 0o700 : 0o755);
  }
  await mkdir(join(tmp, "tmp"));
  await owned(join(tmp, "tmp"), 0o1777);
  for (const f of ["etc/hosts", "etc/hostname", "etc/resolv.conf"]) {
    await writeFile(join(tmp, f), "");
    await owned(join(tmp, f), 0o644);
  }
  if (opts.passwd !== undefined) {
    await writeFile(join(tmp, "etc/passwd"), opts.passwd);
    await owned(join(tmp, "etc/passwd"), 0o644);
  }
  if (opts.group !== undefined) {
    await writeFile(join(tmp, "etc/group"), opts.group);
    await owned(join(tmp, "etc/group"), 0o644);
  }
  await owned(tmp, 0o755);
  await rename(tmp, dir).catch(async (err) => {
    await rm(tmp, { recursive: true, force: true });
    if (!existsSync(dir)) throw err;
  });
  return { dir, digest };
}

/**
 * The /etc/passwd and /etc/group the top layer must carry, if any: root when the image has no root (an image
 * without the files gets them), and an account for an image User whose uid the image's passwd does not list, so
 * the guest agent can run processes as it. The image's own entries are kept as they are.
 */
export function accountFiles(passwd: string | undefined, group: string | undefined, user?: { uid: number; gid: number }): { passwd?: string; group?: string; userName: string } {
  const accounts = parseAccounts(passwd, "passwd");
  let passwdOut: string | undefined;
  const base = () => (passwd === undefined ? "" : passwd.endsWith("\n") || passwd === "" ? passwd : `${passwd}\n`);
  if (!accounts.some((a) => a.id === 0 && a.name === "root")) passwdOut = ROOT_PASSWD + base();
  let userName = "root";
  if (user) {
    const known = accounts.find((a) => a.id === user.uid);
    if (known) userName = known.name;
    else if (user.uid !== 0) {
      userName = `u${user.uid}`;
      passwdOut = (passwdOut ?? base()) + `${userName}:x:${user.uid}:${user.gid}::/:/bin/sh\n`;
    }
  }
  const groupOut = group === undefined ? ROOT_GROUP : undefined;
  return { passwd: passwdOut, group: groupOut, userName };
}
