// The one mapping from a stat to SPEC.md's file info, shared by machine files (the guest agent) and volume files
// (the host); each side names owners its own way (the machine's /etc/passwd, the volume's fixed owner).

import type { Stats } from "node:fs";
import { posix } from "node:path";
import type { FileInfo } from "./protocol.ts";

export interface OwnerNames {
  user(uid: number): string;
  group(gid: number): string;
}

function typeOf(st: Stats): FileInfo["type"] {
  if (st.isSymbolicLink()) return "symlink";
  if (st.isDirectory()) return "directory";
  return "file";
}

/** File info of `path` from its lstat; `symlinkTarget` is set for a symlink. */
export function statToFileInfo(path: string, st: Stats, names: OwnerNames, symlinkTarget?: string): FileInfo {
  const info: FileInfo = {
    name: posix.basename(path) || "/",
    path,
    is_dir: st.isDirectory(),
    size: st.size,
    type: typeOf(st),
    mode: st.mode.toString(8),
    permissions: (st.mode & 0o7777).toString(8).padStart(4, "0"),
    owner: names.user(st.uid),
    group: names.group(st.gid),
    modified_time: st.mtime.toISOString(),
  };
  if (symlinkTarget !== undefined) info.symlink_target = symlinkTarget;
  return info;
}
