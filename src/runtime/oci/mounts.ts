// Mount table lookups shared by the oci driver's root filesystems, disks and network namespace files.

import { readFileSync } from "node:fs";

/** The device a mount point's filesystem comes from (`/dev/loop3`), or undefined when `path` is not mounted. */
export function mountSource(path: string): string | undefined {
  const escaped = escapePath(path);
  for (const line of readFileSync("/proc/self/mountinfo", "utf8").split("\n")) {
    const fields = line.split(" ");
    if (fields[4] !== escaped) continue;
    const rest = fields.slice(fields.indexOf("-") + 1); // after the separator: fstype, source, super options
    return rest[1];
  }
  return undefined;
}

function escapePath(path: string): string {
  return path.replace(/[ \t\n\\]/g, (c) => "\\" + c.charCodeAt(0).toString(8).padStart(3, "0"));
}

/** True when `path` is a mount point in this process's mount namespace (mountinfo escapes blanks as octal). */
export function isMounted(path: string): boolean {
  const escaped = escapePath(path);
  return readFileSync("/proc/self/mountinfo", "utf8").split("\n").some((line) => line.split(" ")[4] === escaped);
}
