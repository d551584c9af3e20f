// The `code-interpreter-v1` template (E2B's default for `@e2b/code-interpreter`): the base template plus Debian's
// numpy, pandas and matplotlib, as one more read-only layer over the base layer. Made like the base template — once,
// in the cache dir, shared by every server on it — by `kiln templates init-code-interpreter` or on the first E2B
// create that names it. The JavaScript kernel needs nothing here: it is the guest agent's own Node.
//
// The layer is the upper dir of an overlay over the base layer in which apt installs the packages (chroot, the
// host's resolver bound in for the mirror's name, then unbound), its new files shifted into the machines' uid range
// as the base layer's are.

import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { mkdir, readFile, rename, rm, writeFile } from "node:fs/promises";
import { join } from "node:path";
import type { Logger } from "../log.ts";
import { run, shiftOwnership, sweepStaleBaseBuilds } from "./base-template.ts";

/** E2B's name for it, which is also its Kiln name (`local/code-interpreter-v1`). */
export const CODE_INTERPRETER_TEMPLATE = "code-interpreter-v1";
/** Bump when the recipe changes: a new version is a new cache entry (and a new artifact). */
export const CODE_INTERPRETER_VERSION = "bookworm-2";
// python3-munkres answers fonttools' "python3-scipy | python3-munkres" dependency: without it apt takes scipy, which brings
// pythran, g++ and Boost (the layer was 1.1 GB).
export const CODE_INTERPRETER_PACKAGES = ["python3-numpy", "python3-pandas", "python3-matplotlib", "python3-munkres"];
const KIND = "code-interpreter";

export interface CodeInterpreterLayer {
  layerDir: string;
  digest: string;
  created: boolean;
}

/** The cached layer if it was made (for this base digest), else undefined. */
export async function cachedCodeInterpreterLayer(cacheDir: string, baseDigest: string): Promise<CodeInterpreterLayer | undefined> {
  const home = homeOf(cacheDir, baseDigest);
  const marker = join(home, "complete.json");
  if (!existsSync(marker)) return undefined;
  const { digest } = JSON.parse(await readFile(marker, "utf8")) as { digest: string };
  return { layerDir: join(home, "layer"), digest, created: false };
}

// One cache entry per recipe version and base layer: the layer holds dpkg's status file, which is only right over
// the base it was installed on.
function homeOf(cacheDir: string, baseDigest: string): string {
  return join(cacheDir, KIND, `${CODE_INTERPRETER_VERSION}-${baseDigest.replace(/^sha256:/, "").slice(0, 12)}`);
}

export async function ensureCodeInterpreterLayer(opts: { cacheDir: string; baseLayerDir: string; baseDigest: string; log: Logger; onProgress?: (line: string) => void }): Promise<CodeInterpreterLayer> {
  await sweepStaleBaseBuilds(opts.cacheDir, opts.log, KIND);
  const cached = await cachedCodeInterpreterLayer(opts.cacheDir, opts.baseDigest);
  if (cached) return cached;
  const progress = opts.onProgress ?? ((line: string) => opts.log.info({ phase: "code-interpreter-template" }, line));
  const home = homeOf(opts.cacheDir, opts.baseDigest);
  const work = join(opts.cacheDir, KIND, `.build-${process.pid}-${Date.now()}`);
  const upper = join(work, "layer");
  const merged = join(work, "merged");
  const mounts: string[] = [];
  const unmountAll = async () => {
    while (mounts.length) await run("umount", ["-l", mounts.pop()!], () => undefined).catch(() => undefined);
  };
  const env = { ...process.env, DEBIAN_FRONTEND: "noninteractive", LANG: "C.UTF-8", LC_ALL: "C.UTF-8" };
  await mkdir(upper, { recursive: true });
  await mkdir(join(work, "ovl-work"), { recursive: true });
  await mkdir(merged, { recursive: true });
  try {
    await run("mount", ["-t", "overlay", "overlay", "-o", `lowerdir=${opts.baseLayerDir},upperdir=${upper},workdir=${join(work, "ovl-work")}`, merged], progress);
    mounts.push(merged);
    await run("mount", ["-t", "proc", "proc", join(merged, "proc")], progress);
    mounts.push(join(merged, "proc"));
    // The base layer's resolv.conf is an empty mount point; the mirror is named, so the host's resolver is lent.
    await run("mount", ["--bind", "-o", "ro", "/etc/resolv.conf", join(merged, "etc/resolv.conf")], progress);
    mounts.push(join(merged, "etc/resolv.conf"));
    await writeFile(join(merged, "usr/sbin/policy-rc.d"), "#!/bin/sh\nexit 101\n", { mode: 0o755 });
    progress(`apt-get install ${CODE_INTERPRETER_PACKAGES.join(" ")}`);
    // apt's download sandbox user would meet a base layer owned by the machines' uid range: downloads run as root.
    const apt = ["-y", "-q", "-o", "APT::Sandbox::User=root"];
    await run("chroot", [merged, "apt-get", ...apt, "update"], progress, env);
    await run("chroot", [merged, "apt-get", ...apt, "install", "--no-install-recommends", ...CODE_INTERPRETER_PACKAGES], (l) => /^(Setting up|Unpacking|E:) /.test(l) && progress(l), env);
    // Matplotlib's font cache, made now for the machines' user so its first plot does not spend seconds on it.
    // (as root with the user's HOME, then given to the user: the base layer's /home/user is already shifted).
    const warm = "python3 -c \"import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot, pandas, numpy\" && chown -R 1000:1000 /home/user/.cache";
    await run("chroot", [merged, "sh", "-c", warm], progress, { ...env, HOME: "/home/user" }).catch((err: unknown) => progress(`warming matplotlib failed: ${(err as Error).message}`));
    await run("chroot", [merged, "sh", "-c", "apt-get clean && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d /var/log/*.log /var/log/apt/* /var/cache/debconf/*-old /var/cache/ldconfig/aux-cache"], progress, env);
    await unmountAll();
    progress("shifting ownership into the machines' uid range");
    await shiftOwnership(upper);
    const digest = "sha256:" + createHash("sha256").update(`${CODE_INTERPRETER_VERSION}\n${opts.baseDigest}\n${CODE_INTERPRETER_PACKAGES.join(",")}\n${Date.now()}`).digest("hex");
    await writeFile(join(work, "complete.json"), JSON.stringify({ digest, base: opts.baseDigest, version: CODE_INTERPRETER_VERSION, created_at: new Date().toISOString() }));
    await rm(join(work, "merged"), { recursive: true, force: true });
    await rm(join(work, "ovl-work"), { recursive: true, force: true });
    // Another process sharing the cache may have finished first, and machines may already run on its layer.
    const theirs = await cachedCodeInterpreterLayer(opts.cacheDir, opts.baseDigest);
    if (theirs) {
      await rm(work, { recursive: true, force: true });
      return theirs;
    }
    await rm(home, { recursive: true, force: true });
    await rename(work, home);
    progress(`code-interpreter-v1 layer ready at ${join(home, "layer")}`);
    return { layerDir: join(home, "layer"), digest, created: true };
  } catch (err) {
    await unmountAll();
    await rm(work, { recursive: true, force: true });
    throw err;
  }
}
