// Directory listings in pages (files/list of machines and of volumes): depth-first, each directory's names in
// JavaScript string order (as a whole listing always was), at most `limit` entries per page, the next page starting
// after the path of the last entry. Nothing holds a whole directory: each look at a directory streams its names and
// keeps only the next ones in order (a heap bounded by what the page still needs), so a directory of 400k names
// costs one scan per page, never 400k names in memory. Used by the guest agent and by the server for volumes.

import { opendirSync } from "node:fs";
import type { Dirent } from "node:fs";

/** Entries per page unless asked (large enough that an ordinary directory still comes in one answer). */
export const LIST_DEFAULT_LIMIT = 1000;
/** The most entries a page may ask for. */
export const LIST_MAX_LIMIT = 10_000;
/** The deepest a listing may go (a cursor is at most this many names). */
export const LIST_MAX_DEPTH = 20;

/** How a listing reaches one kind of directory (paths in a machine, fds of a volume). */
export interface TreeSource<D, E> {
  /** Every name in `dir` (no order; `.` and `..` left out), streamed in batches (see dirNames). */
  names(dir: D): AsyncIterable<string[]>;
  /** The entry `name` of `dir` at `path` (names from the listed root), or undefined when it went meanwhile. */
  entry(dir: D, name: string, path: string[]): Promise<{ entry: E; isDir: boolean } | undefined>;
  /** The directory `name` of `dir`, opened to walk into; undefined when it went (or was swapped) meanwhile. */
  open(dir: D, name: string): Promise<D | undefined>;
  close(dir: D): Promise<void>;
}

/** Entries looked up (lstat) at once. */
const LOOKUPS_AT_ONCE = 128;
/** Names read from a directory between two turns of the event loop. */
const NAMES_PER_TURN = 4096;

/**
 * The names in the directory at `path`, in batches: read synchronously (a per-name promise costs more than the
 * syscall), NAMES_PER_TURN at a time, letting the event loop run between batches, so a huge directory neither
 * sits in memory nor holds up other requests. Errors (the directory itself unreadable) surface from the first batch.
 */
export async function* dirNames(path: string): AsyncIterable<string[]> {
  const dir = opendirSync(path, { bufferSize: 1024 });
  try {
    for (;;) {
      const batch: string[] = [];
      let entry: Dirent | null = null;
      while (batch.length < NAMES_PER_TURN && (entry = dir.readSync()) !== null) batch.push(entry.name);
      if (batch.length > 0) yield batch;
      if (entry === null) return;
      await new Promise((resolve) => setImmediate(resolve));
    }
  } finally {
    dir.closeSync();
  }
}

/** Whether `after` is a cursor's path a listing of `depth` could have given: names, no separators, not too deep. */
export function validAfter(after: unknown, depth: number): after is string[] {
  return (
    Array.isArray(after) &&
    after.length > 0 &&
    after.length <= depth &&
    after.every((n) => typeof n === "string" && n.length > 0 && n.length <= 4096 && n !== "." && n !== ".." && !n.includes("/") && !n.includes("\0"))
  );
}

/** A max-heap of at most `cap` names: what it holds at the end are the `cap` smallest names offered. */
class SmallestNames {
  private readonly heap: string[] = [];
  private readonly cap: number;
  constructor(cap: number) {
    this.cap = cap;
  }

  offer(name: string) {
    const h = this.heap;
    if (h.length < this.cap) {
      h.push(name);
      let i = h.length - 1;
      while (i > 0) {
        const parent = (i - 1) >> 1;
        if (h[parent] >= h[i]) break;
        [h[parent], h[i]] = [h[i], h[parent]];
        i = parent;
      }
    } else if (this.cap > 0 && name < h[0]) {
      h[0] = name;
      let i = 0;
      for (;;) {
        const l = 2 * i + 1;
        const r = l + 1;
        let top = i;
        if (l < h.length && h[l] > h[top]) top = l;
        if (r < h.length && h[r] > h[top]) top = r;
        if (top === i) break;
        [h[top], h[i]] = [h[i], h[top]];
        i = top;
      }
    }
  }

  sorted(): string[] {
    return [...this.heap].sort();
  }
}

/** The `count` smallest names of `dir` after `after` (all of them from the start without it), in order. */
async function nextNames<D, E>(src: TreeSource<D, E>, dir: D, after: string | undefined, count: number): Promise<string[]> {
  const keep = new SmallestNames(count);
  for await (const batch of src.names(dir)) for (const name of batch) if (after === undefined || name > after) keep.offer(name);
  return keep.sorted();
}

/**
 * One page of the tree under `root`, `depth` levels deep (1: its own entries), starting after the entry at path
 * `after`. `next` is the path to pass as `after` for the next page, absent on the last one.
 */
export async function listPage<D, E>(src: TreeSource<D, E>, root: D, opts: { depth: number; limit: number; after?: string[] }): Promise<{ entries: E[]; next?: string[] }> {
  const out: { entry: E; path: string[] }[] = [];
  // One more than the page: if it is found, there is a next page (and no empty last page is ever answered).
  const want = opts.limit + 1;

  /** Lists `dir` (at `level`, reached by `prefix`), resuming inside it at `resume`; true once the page is full. */
  async function visit(dir: D, level: number, prefix: string[], resume: string[] | undefined): Promise<boolean> {
    let last: string | undefined;
    if (resume && resume.length > 0) {
      // The cursor's entry here was given already: what follows it is its subtree (the rest of the cursor), then
      // the names after it.
      last = resume[0];
      if (level < opts.depth && (await descend(dir, last, level, prefix, resume.slice(1)))) return true;
    }
    for (;;) {
      const need = want - out.length;
      const names = await nextNames(src, dir, last, need);
      // Looked up a chunk at a time, concurrently (one lstat after another would wait on the thread pool each
      // time), then taken in order: a directory's subtree still comes right after it.
      for (let i = 0; i < names.length; i += LOOKUPS_AT_ONCE) {
        const chunk = names.slice(i, i + LOOKUPS_AT_ONCE);
        const found = await Promise.all(chunk.map((name) => src.entry(dir, name, [...prefix, name])));
        for (let j = 0; j < chunk.length; j++) {
          const name = chunk[j];
          last = name;
          const hit = found[j];
          if (!hit) continue; // removed while we listed
          out.push({ entry: hit.entry, path: [...prefix, name] });
          if (out.length >= want) return true;
          if (hit.isDir && level < opts.depth && (await descend(dir, name, level, prefix, undefined))) return true;
        }
      }
      if (names.length < need) return false;
    }
  }

  async function descend(dir: D, name: string, level: number, prefix: string[], resume: string[] | undefined): Promise<boolean> {
    const child = await src.open(dir, name);
    if (child === undefined) return false;
    try {
      return await visit(child, level + 1, [...prefix, name], resume);
    } finally {
      await src.close(child);
    }
  }

  await visit(root, 1, [], opts.after);
  const more = out.length > opts.limit;
  const page = out.slice(0, opts.limit);
  return { entries: page.map((e) => e.entry), ...(more ? { next: page.at(-1)!.path } : {}) };
}
