// Mount table lookups shared by the oci driver's root filesystems and network namespace files.

import { readFileSync } from "node:fs";

/** True when `path` is a mount point in this process's mount namespace (mountinfo escapes blanks as octal). */
export function isMounted(path: string): boolean {
  const escaped = path.replace(/[ \t\n\\]/g, (c) => "\\" + c.charCodeAt(0).toString(8).padStart(3, "0"));
  return readFileSync("/proc/self/mountinfo", "utf8").split("\n").some((line) => line.split(" ")[4] === escaped);
}
