// Walking a live server's data dir for secrets: machines are created and removed while the walk runs (their cleanup
// goes on behind a DELETE), so a directory that vanishes under the walk is skipped, not an error.

import { readdir, readFile } from "node:fs/promises";
import { join } from "node:path";

/** Every regular file under `dir` with its contents, skipping what vanishes mid-walk and machines' root filesystems. */
export async function* filesWithContents(dir: string): AsyncGenerator<{ path: string; text: Buffer }> {
  let entries;
  try {
    entries = await readdir(dir, { withFileTypes: true });
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT" || (err as NodeJS.ErrnoException).code === "ENOTDIR") return;
    throw err;
  }
  for (const e of entries) {
    const path = join(dir, e.name);
    // Machine root filesystems are the template's bytes; records, logs and Kiln's own files are what matter.
    if (e.name === "rootfs") continue;
    if (e.isDirectory()) yield* filesWithContents(path);
    else if (e.isFile()) {
      const text = await readFile(path).catch(() => null);
      if (text) yield { path, text };
    }
  }
}
