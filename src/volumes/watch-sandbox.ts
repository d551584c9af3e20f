// How a volume's inotifywait is started: in its own mount namespace, chrooted into a tiny root holding only the
// binary, its libraries and the volume at /vol, so no symlink a machine makes can point it at a host directory.

import { execFileSync } from "node:child_process";
import { dirname } from "node:path";

const INOTIFYWAIT = "/usr/bin/inotifywait";
/** Where the volume appears inside the watcher's root; event paths start with it. */
export const WATCH_ROOT = "/vol";

let files: string[] | undefined;

/** inotifywait and every shared object it loads (from ldd), the ELF interpreter included. */
function runtimeFiles(): string[] {
  if (files) return files;
  const out = execFileSync("ldd", [INOTIFYWAIT], { encoding: "utf8" });
  const libs = [...out.matchAll(/(?:=>\s*)?(\/\S+)\s+\(0x/g)].map((m) => m[1]);
  files = [INOTIFYWAIT, ...new Set(libs)];
  return files;
}

/**
 * The command line: setpriv gives the watcher SIGKILL when the server dies (nothing outlives a kill -9), unshare a
 * private mount namespace, and the script builds the root on a tmpfs there (invisible to the host) and execs
 * `chroot <root> inotifywait … /vol`, so the pid Kiln holds is inotifywait's own.
 */
export function sandboxedInotifywait(opts: { volumeMount: string; stagingDir: string; args: string[] }): { command: string; args: string[] } {
  const binds = runtimeFiles()
    .map((f) => `mkdir -p "$R${dirname(f)}" && : > "$R${f}" && mount --bind "${f}" "$R${f}"`)
    .join(" && ");
  const script = [
    "set -e",
    'R="$KILN_WATCH_ROOT"',
    'mount -t tmpfs -o size=1m,mode=0755 kiln-watch "$R"',
    binds,
    `mkdir "$R${WATCH_ROOT}" && mount --bind "$KILN_VOLUME_MOUNT" "$R${WATCH_ROOT}"`,
    `exec chroot "$R" ${INOTIFYWAIT} "$@"`,
  ].join("\n");
  return {
    command: "setpriv",
    args: ["--pdeathsig", "KILL", "--", "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "kiln-watch", ...opts.args],
  };
}

export function sandboxEnv(opts: { volumeMount: string; stagingDir: string }): NodeJS.ProcessEnv {
  return { PATH: "/usr/sbin:/usr/bin:/sbin:/bin", KILN_WATCH_ROOT: opts.stagingDir, KILN_VOLUME_MOUNT: opts.volumeMount };
}
