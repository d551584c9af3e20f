// Machine path resolution, exactly as SPEC.md's file metadata request says: absolute paths are normalised;
// relative ones resolve from the machine's cwd when set, else from the home of the given user, else /workspace.

import { posix } from "node:path";
import { KilnError } from "../errors.ts";

export const DEFAULT_WORKDIR = "/workspace";

export function resolveMachinePath(path: string, ctx: { machineCwd?: string | null; userHome?: string | null }): string {
  if (path.includes("\0")) throw new KilnError("invalid_request", "A path must not contain a NUL byte");
  if (path.startsWith("/")) return posix.normalize(path);
  const base = ctx.machineCwd || ctx.userHome || DEFAULT_WORKDIR;
  // posix.resolve never climbs above "/", so "../../etc" from /workspace lands on /etc, normalised.
  return posix.resolve(base, path);
}

/** True when resolving `path` needs the user's home (relative path, no machine cwd, a user given). */
export function needsUserHome(path: string, machineCwd: string | null | undefined, user: string | undefined): boolean {
  return !path.startsWith("/") && !machineCwd && Boolean(user);
}
