// Tiny root filesystems made from the host's own files, for images the tests push: a shell with libc and no Node
// (Alpine-sized), and a "distroless" one holding a single static binary.

import { execFileSync } from "node:child_process";
import { existsSync, readFileSync, realpathSync } from "node:fs";
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

/**
 * Debian's static busybox as /bin/busybox with every applet it has linked beside it (sh, ps, kill, nc, seq, …),
 * /tmp and /root: a small image whose RUN steps can probe processes, sockets and limits.
 */
export function busyboxRootfs(): TarEntry[] {
  const applets = execFileSync("/bin/busybox", ["--list"]).toString().split("\n").filter((a) => /^[a-z0-9_.[-]+$/.test(a) && a !== "busybox");
  return [
    { name: "bin/", type: "directory" },
    file("bin/busybox", "/bin/busybox"),
    ...applets.map((a): TarEntry => ({ name: `bin/${a}`, type: "symlink", linkname: "busybox" })),
    { name: "tmp/", type: "directory", mode: 0o1777 },
    { name: "root/", type: "directory", mode: 0o700 },
    { name: "etc/", type: "directory" },
    { name: "etc/passwd", content: "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n", mode: 0o644 },
    { name: "etc/group", content: "root:x:0:\nnogroup:x:65534:\n", mode: 0o644 },
  ];
}

export function busyboxAvailable(): boolean {
  return existsSync("/bin/busybox");
}
