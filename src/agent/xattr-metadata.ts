// User metadata of files (E2B's `files.write(..., {metadata})`), stored as envd stores it: one `user.e2b.<key>`
// extended attribute per key on the file itself, so it follows the file through renames and moves, dies with it,
// and what a program in the machine sets with setfattr (or os.setxattr) under that prefix is surfaced too.
//
// Node has no xattr call: the agent loads the prebuilt N-API addon of `@napi-rs/xattr` (bundle.ts copies its
// glibc .node beside the agent; the guest runtime carries the libraries it links). It is required by path, never
// through the package's loader, which would read /usr/bin/ldd — and may run `ldd` — from the machine's own root.

import { createRequire } from "node:module";
import type * as Xattr from "@napi-rs/xattr";

/** envd's namespace: `user.` is what unprivileged programs may set, `e2b.` keeps other tools' attributes apart. */
export const METADATA_XATTR_PREFIX = "user.e2b.";
/**
 * Metadata surfaced per entry, counted as envd counts a write's budget (prefix + key + value): what a program in
 * the machine set beyond it is left out (keys in name order), so one file cannot swell every listing page.
 */
export const MAX_SURFACED_METADATA_BYTES = 4096;

/** Where bundle.ts puts the addon, relative to the bundle's files. */
export const XATTR_ADDON = "native/xattr.node";

let addon: typeof Xattr | null | undefined;

function xattr(): typeof Xattr | null {
  if (addon === undefined) {
    try {
      addon = createRequire(import.meta.url)(`./${XATTR_ADDON}`) as typeof Xattr;
    } catch {
      addon = null; // not bundled (an agent run from source): no metadata, as on a filesystem without xattrs
    }
  }
  return addon;
}

/** The errno number of an addon error ("... (os error 95)"). */
function errnoOf(err: unknown): number | undefined {
  const m = /\(os error (\d+)\)/.exec(String((err as Error)?.message ?? err));
  return m ? Number(m[1]) : undefined;
}
const ENOTSUP = 95;
const ENODATA = 61;

/**
 * The `user.e2b.*` metadata of `path` (not following a symlink: callers pass the target's path for one), or
 * undefined when it has none; null when its filesystem refuses user xattrs. Best effort,
 * as envd: a file that cannot be read has none, and a value that is not UTF-8 (set inside the machine) is skipped.
 */
export function readMetadata(path: string): Record<string, string> | undefined | null {
  const x = xattr();
  if (!x) return null;
  // Synchronous: one listxattr(2) per entry costs ~1.5 µs this way, and as much as the entry's lstat through the
  // addon's thread pool (measured: 1 000 files, 1.5 ms vs 11 ms); most files have no attribute to read at all.
  let names: string[];
  try {
    names = x.listAttributesSync(path);
  } catch (err) {
    return errnoOf(err) === ENOTSUP ? null : undefined;
  }
  const keys = names.filter((n) => n.startsWith(METADATA_XATTR_PREFIX) && n.length > METADATA_XATTR_PREFIX.length).sort();
  if (keys.length === 0) return undefined;
  const out = new Map<string, string>(); // a Map: the machine names the keys, `__proto__` included
  let bytes = 0;
  const decoder = new TextDecoder("utf-8", { fatal: true });
  for (const name of keys) {
    let value: Buffer | null;
    try {
      value = x.getAttributeSync(path, name);
    } catch {
      continue; // removed meanwhile
    }
    if (value === null) continue;
    let text: string;
    try {
      text = decoder.decode(value);
    } catch {
      continue;
    }
    bytes += Buffer.byteLength(name) + value.length;
    if (bytes > MAX_SURFACED_METADATA_BYTES) break;
    out.set(name.slice(METADATA_XATTR_PREFIX.length), text);
  }
  return out.size > 0 ? Object.fromEntries(out) : undefined;
}

/**
 * Sets `metadata` as `user.e2b.*` attributes of `path` (a new file: nothing to clear); false when its filesystem
 * keeps no user xattrs (the caller keeps the metadata another way).
 */
export async function writeMetadata(path: string, metadata: Record<string, string>): Promise<boolean> {
  const x = xattr();
  if (!x) return false;
  for (const [key, value] of Object.entries(metadata)) {
    try {
      await x.setAttribute(path, METADATA_XATTR_PREFIX + key, value);
    } catch (err) {
      const errno = errnoOf(err);
      if (errno === ENOTSUP) return false;
      throw Object.assign(new Error(`setting file metadata ${key}: ${(err as Error).message}`), { code: errno === ENODATA ? "ENODATA" : errno === 28 ? "ENOSPC" : "EXATTR" });
    }
  }
  return true;
}
