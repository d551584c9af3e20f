// Tiny root filesystems made from the host's own files, for images the tests push: a shell with libc and no Node
// (Alpine-sized), and a "distroless" one holding a single static binary.

import { readFileSync, realpathSync } from "node:fs";
import type { TarEntry } from "./oci-registry.ts";

const LIBC = "/lib/x86_64-linux-gnu/libc.so.6";
const LOADER = "/lib64/ld-linux-x86-64.so.2";

export function hostArchSupported(): boolean {
  return process.arch === "x64";
}

const file = (name: string, from: string, mode = 0o755): TarEntry => ({ name, content: readFileSync(realpathSync(from)), mode });

/** dash as /bin/sh, coreutils' cat, and the C library they load; no /etc at all. */
export function shellRootfs(): TarEntry[] {
  return [
    { name: "bin/", type: "directory" },
    file("bin/sh", "/bin/dash"),
    file("bin/cat", "/bin/cat"),
    { name: "lib/", type: "directory" },
    { name: "lib/x86_64-linux-gnu/", type: "directory" },
    file("lib/x86_64-linux-gnu/libc.so.6", LIBC),
    { name: "lib64/", type: "directory" },
    file("lib64/ld-linux-x86-64.so.2", LOADER),
  ];
}

/** One statically linked program (tini-static from Debian's tini) and nothing else. */
export function distrolessRootfs(): TarEntry[] {
  return [file("tini", "/usr/bin/tini-static")];
}
