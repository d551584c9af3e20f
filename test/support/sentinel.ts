// A sentinel directory that hostile imports aim at (through symlinks, hard links, whiteouts, xattrs, `../`), and
// a fingerprint of it that changes with anything done to it: names, types, modes, owners, sizes, link counts,
// contents, extended attributes and ctimes (which move on every metadata change, chown and setxattr included).

import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { lstatSync, mkdirSync, readFileSync, readdirSync, readlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";

/** Fills `dir` with a small tree: a private file, a directory with a file, a file carrying a user xattr. */
export function makeSentinel(dir: string): void {
  mkdirSync(join(dir, "victim", "inner"), { recursive: true });
  writeFileSync(join(dir, "secret"), "sentinel secret\n", { mode: 0o600 });
  writeFileSync(join(dir, "victim", "file"), "victim file\n");
  writeFileSync(join(dir, "victim", "inner", "deep"), "deep\n");
  writeFileSync(join(dir, "f"), "plain\n", { mode: 0o755 });
  execFileSync("setfattr", ["-n", "user.sentinel", "-v", "kept", join(dir, "f")]);
}

/** Everything about `dir`'s tree a write through it would change (atimes excepted: reads may move them). */
export function fingerprint(dir: string): string {
  const lines: string[] = [];
  const walk = (path: string, rel: string) => {
    const st = lstatSync(path);
    let content = "";
    if (st.isFile()) content = createHash("sha256").update(readFileSync(path)).digest("hex");
    else if (st.isSymbolicLink()) content = readlinkSync(path);
    lines.push([rel, st.mode.toString(8), st.uid, st.gid, st.size, st.nlink, st.rdev, st.mtimeMs, st.ctimeMs, content].join(" "));
    if (st.isDirectory()) for (const name of readdirSync(path).sort()) walk(join(path, name), `${rel}/${name}`);
  };
  walk(dir, ".");
  const xattrs = execFileSync("getfattr", ["-R", "-h", "-d", "-m", "-", "--absolute-names", dir], { stdio: ["ignore", "pipe", "ignore"] }).toString();
  return `${lines.join("\n")}\n${xattrs}`;
}
