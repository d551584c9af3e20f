// One inotify watcher per volume: `inotifywait -m -r` on the host mount sees every change, made through the API
// or by any machine mounting the volume (it is one filesystem). Turns its lines into file events and tells when
// events may have been lost (queue overflow, a restart of the watcher) so subscribers can ask clients to resync.

import { spawn } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { posix } from "node:path";
import type { Logger } from "../log.ts";
import type { VolumeFiles } from "./files.ts";
import { UPLOAD_PREFIX, UPLOAD_REPLACES } from "./files.ts";
import { WATCH_ROOT, sandboxEnv, sandboxedInotifywait } from "./watch-sandbox.ts";

export const FILE_EVENT_KINDS = ["create", "write", "remove", "rename", "chmod"] as const;
export type FileEventKind = (typeof FILE_EVENT_KINDS)[number];
export const RESYNC_REASONS = ["overflow", "slow_client", "watcher_restarted", "too_many_new_entries"] as const;
export type ResyncReason = (typeof RESYNC_REASONS)[number];

export interface WatcherOptions {
  /** The volume's host mount. */
  mountPath: string;
  /** An empty host directory the watcher's private root is mounted on (in its own namespace only). */
  stagingDir: string;
  files: VolumeFiles;
  sink: WatcherSink;
  log: Logger;
}

export interface FileEvent {
  event: FileEventKind;
  /** Volume path, rooted at `/`. */
  path: string;
  isDir: boolean;
}

export interface WatcherSink {
  events(batch: FileEvent[]): void;
  resync(reason: ResyncReason): void;
}

const INOTIFY_EVENTS = ["create", "modify", "attrib", "delete", "moved_from", "moved_to"];
const READY_LINE = "Watches established.";
const START_TIMEOUT_MS = 30_000;
/** A directory created with more entries than this (before its watch existed) is announced as a resync instead. */
const MAX_SYNTHESISED = 2000;
/** How long a create is remembered to drop the copy that the scan of a new directory and inotify may both report. */
const CREATE_DEDUP_MS = 2000;
const RESTART_DELAYS_MS = [0, 100, 500, 2000];
/** When a new directory is looked at again, by which time inotifywait watches everything below it. */
const SETTLE_MS = 150;

/**
 * The watcher of one mounted volume. `start()` resolves once every existing directory is watched, so events after
 * it are not missed. A watcher that dies on its own is restarted and reports `watcher_restarted`.
 */
export class VolumeWatcher {
  private child: ChildProcess | undefined;
  private stopping = false;
  private restarts = 0;
  private pending = "";
  /** Lines are handled one after another: the scan of a new directory finishes before later lines are looked at. */
  private chain: Promise<void> = Promise.resolve();
  private readonly recentCreates = new Map<string, number>();
  private readonly scannedDirs = new Map<string, number>();
  /** New directories being settled: what clients were told exists below each (path → is_dir), checked again soon. */
  private readonly settling = new Map<string, Map<string, boolean>>();
  private readonly timers = new Set<NodeJS.Timeout>();
  /** The API upload whose rename into place comes next (its MOVED_FROM is hidden, its MOVED_TO is not). */
  private upload: { dir: string; replaces: boolean } | undefined;
  private readonly mount: string;
  private readonly opts: WatcherOptions;

  constructor(opts: WatcherOptions) {
    this.opts = opts;
    this.mount = opts.mountPath.replace(/\/+$/, "");
  }

  /** Host pid of the inotifywait process (tests end it to prove a restart is announced). */
  get pid(): number | undefined {
    return this.child?.pid;
  }

  async start(): Promise<void> {
    this.stopping = false;
    await this.spawn();
  }

  private spawn(): Promise<void> {
    return new Promise((resolve, reject) => {
      // -P: never follow a symlink a machine made; the sandbox makes sure that even a swapped parent leads nowhere.
      const args = ["-m", "-r", "-P", "--no-newline", "--format", "%e %w%f%0", ...INOTIFY_EVENTS.flatMap((e) => ["-e", e]), WATCH_ROOT];
      const sandbox = { volumeMount: this.mount, stagingDir: this.opts.stagingDir };
      const { command, args: argv } = sandboxedInotifywait({ ...sandbox, args });
      const child = spawn(command, argv, { stdio: ["ignore", "pipe", "pipe"], env: sandboxEnv(sandbox) });
      this.child = child;
      this.pending = "";
      let ready = false;
      let stderr = "";
      const timer = setTimeout(() => {
        if (!ready) {
          child.kill("SIGKILL");
          reject(new Error("inotifywait did not establish its watches in time"));
        }
      }, START_TIMEOUT_MS);
      child.stderr!.setEncoding("utf8");
      child.stderr!.on("data", (text: string) => {
        if (ready) return void this.opts.log.warn({ stderr: text.trim().slice(0, 500) }, "volume watcher said something");
        stderr += text;
        if (stderr.includes(READY_LINE)) {
          ready = true;
          clearTimeout(timer);
          resolve();
        }
      });
      child.stdout!.setEncoding("utf8");
      child.stdout!.on("data", (text: string) => this.onData(text));
      child.on("error", (err) => {
        clearTimeout(timer);
        if (!ready) reject(err);
      });
      child.on("exit", (code, signal) => {
        clearTimeout(timer);
        if (this.child === child) this.child = undefined;
        if (!ready) return reject(new Error(`inotifywait exited (${code ?? signal}) before it was ready: ${stderr.trim().slice(0, 300)}`));
        if (this.stopping) return;
        this.opts.log.warn({ code, signal, mount: this.mount }, "volume watcher stopped; restarting it");
        void this.restart();
      });
    });
  }

  private async restart() {
    const delay = RESTART_DELAYS_MS[Math.min(this.restarts++, RESTART_DELAYS_MS.length - 1)];
    await new Promise((r) => setTimeout(r, delay));
    if (this.stopping) return;
    try {
      await this.spawn();
      this.restarts = 0;
      // Whatever changed between the old watcher's end and the new one's start was not seen.
      this.opts.sink.resync("watcher_restarted");
    } catch (err) {
      this.opts.log.error({ err, mount: this.mount }, "restarting a volume watcher failed");
      if (!this.stopping) void this.restart();
    }
  }

  async stop(): Promise<void> {
    this.stopping = true;
    for (const t of this.timers) clearTimeout(t);
    this.timers.clear();
    const child = this.child;
    this.child = undefined;
    if (!child || child.exitCode !== null || child.signalCode !== null) return;
    await new Promise<void>((resolve) => {
      child.once("exit", () => resolve());
      child.kill("SIGTERM");
    });
  }

  private onData(text: string) {
    const records = (this.pending + text).split("\0");
    this.pending = records.pop() ?? "";
    this.chain = this.chain.then(() => this.handle(records)).catch((err: unknown) => this.opts.log.error({ err }, "handling volume events failed"));
  }

  /** The watcher's path (`/vol/…`) → volume path; undefined for anything else (never expected). */
  private volumePath(watchPath: string): string | undefined {
    const p = watchPath.replace(/\/+$/, "");
    if (p === WATCH_ROOT) return "/";
    if (!p.startsWith(WATCH_ROOT + "/")) return undefined;
    return p.slice(WATCH_ROOT.length);
  }

  private async handle(records: string[]) {
    const batch: FileEvent[] = [];
    const flush = () => {
      if (batch.length > 0) this.opts.sink.events(batch.splice(0));
    };
    for (const record of records) {
      const space = record.indexOf(" ");
      const flags = (space < 0 ? record : record.slice(0, space)).split(",");
      if (flags.includes("Q_OVERFLOW")) {
        flush();
        this.opts.sink.resync("overflow");
        continue;
      }
      const path = space < 0 ? undefined : this.volumePath(record.slice(space + 1));
      if (!path || path === "/") continue;
      const name = posix.basename(path);
      if (name.startsWith(UPLOAD_PREFIX)) {
        // An API upload in flight is not shown; its rename into place is the event (a write when it replaces a file).
        if (flags.includes("MOVED_FROM")) this.upload = { dir: posix.dirname(path), replaces: name[UPLOAD_PREFIX.length] === UPLOAD_REPLACES };
        continue;
      }
      const isDir = flags.includes("ISDIR");
      let kind = kindOf(flags);
      if (!kind) continue;
      if (flags.includes("MOVED_TO") && this.upload?.dir === posix.dirname(path)) {
        if (this.upload.replaces) kind = "write";
        this.upload = undefined;
      }
      this.track({ event: kind, path, isDir });
      if (kind === "create") {
        // Only below a directory just scanned can inotify repeat what the scan announced.
        const repeated = this.underRecentScan(path) && !this.rememberCreate(path);
        if (!repeated) batch.push({ event: "create", path, isDir });
        // Scanned even when already announced: what it holds now may be newer than that scan.
        if (isDir && flags.includes("CREATE")) {
          flush();
          await this.announceEntriesOf(path);
        }
        continue;
      }
      if (kind === "remove" || kind === "rename") this.forgetCreates(path);
      if (kind === "write" && batch.at(-1)?.event === "write" && batch.at(-1)?.path === path) continue; // one write per burst
      batch.push({ event: kind, path, isDir });
    }
    flush();
  }

  /**
   * A directory made with `mkdir -p a/b/c` and written into at once can fill before inotifywait has added its
   * watch: what is already there is announced as created (each entry once, whether the scan or inotify saw it first).
   */
  private async announceEntriesOf(dir: string) {
    this.scannedDirs.set(dir, Date.now());
    let entries;
    try {
      // One page one entry larger than what is announced: a next page means too many.
      const page = await this.opts.files.list(dir, 64, { limit: MAX_SYNTHESISED });
      if (page.next) return this.opts.sink.resync("too_many_new_entries");
      entries = page.entries;
    } catch {
      return; // gone again already; its remove event follows
    }
    const batch: FileEvent[] = [];
    const known = new Map<string, boolean>();
    for (const e of entries) {
      if (e.name.startsWith(UPLOAD_PREFIX)) continue;
      known.set(e.path, e.is_dir);
      if (!this.rememberCreate(e.path)) continue;
      batch.push({ event: "create", path: e.path, isDir: e.is_dir });
      if (e.type === "file" && e.size > 0) batch.push({ event: "write", path: e.path, isDir: false });
    }
    if (batch.length > 0) this.opts.sink.events(batch);
    // What changes below before inotifywait's own watches cover it (an entry made and removed at once) is seen by
    // nobody: look again shortly, when they do, and announce the difference.
    this.settling.set(dir, known);
    const timer = setTimeout(() => {
      this.timers.delete(timer);
      this.chain = this.chain.then(() => this.settle(dir)).catch((err: unknown) => this.opts.log.error({ err }, "settling a new directory failed"));
    }, SETTLE_MS);
    this.timers.add(timer);
  }

  private async settle(dir: string) {
    const known = this.settling.get(dir);
    this.settling.delete(dir);
    if (!known || this.stopping) return;
    const present = new Map<string, boolean>();
    const page = await this.opts.files.list(dir, 64, { limit: MAX_SYNTHESISED }).catch(() => ({ entries: [], next: undefined }));
    // Grown past what is announced one by one since: the picture is lost either way.
    if (page.next) return this.opts.sink.resync("too_many_new_entries");
    const entries = page.entries;
    for (const e of entries) if (!e.name.startsWith(UPLOAD_PREFIX)) present.set(e.path, e.is_dir);
    const batch: FileEvent[] = [];
    // Deepest first, as a real removal of a tree reports it.
    const gone = [...known.keys()].filter((p) => !present.has(p)).sort((a, b) => b.length - a.length);
    for (const p of gone) batch.push({ event: "remove", path: p, isDir: known.get(p)! });
    for (const [p, isDir] of present) if (!known.has(p)) batch.push({ event: "create", path: p, isDir });
    for (const e of batch) this.track(e);
    if (batch.length > 0) this.opts.sink.events(batch);
  }

  /** Keeps the picture of directories being settled up to date with every event sent. */
  private track(e: FileEvent) {
    for (const [dir, known] of this.settling) {
      if (!e.path.startsWith(dir + "/")) continue;
      if (e.event === "create") known.set(e.path, e.isDir);
      else if (e.event === "remove" || e.event === "rename") {
        known.delete(e.path);
        for (const p of known.keys()) if (p.startsWith(e.path + "/")) known.delete(p);
      }
    }
  }

  private underRecentScan(path: string): boolean {
    if (this.scannedDirs.size === 0) return false;
    const now = Date.now();
    for (const [dir, t] of this.scannedDirs) {
      if (now - t >= CREATE_DEDUP_MS) this.scannedDirs.delete(dir);
      else if (path.startsWith(dir + "/")) return true;
    }
    return false;
  }

  /** False when this create was reported a moment ago (by the scan or by inotify). */
  private rememberCreate(path: string): boolean {
    const now = Date.now();
    const seen = this.recentCreates.get(path);
    if (seen !== undefined && now - seen < CREATE_DEDUP_MS) return false;
    this.recentCreates.set(path, now);
    if (this.recentCreates.size > 10_000) {
      for (const [p, t] of this.recentCreates) if (now - t >= CREATE_DEDUP_MS) this.recentCreates.delete(p);
    }
    return true;
  }

  private forgetCreates(path: string) {
    this.recentCreates.delete(path);
    if (this.recentCreates.size === 0) return;
    const prefix = path + "/";
    for (const p of this.recentCreates.keys()) if (p.startsWith(prefix)) this.recentCreates.delete(p);
  }
}

function kindOf(flags: string[]): FileEventKind | undefined {
  if (flags.includes("CREATE") || flags.includes("MOVED_TO")) return "create";
  if (flags.includes("MOVED_FROM")) return "rename";
  if (flags.includes("DELETE")) return "remove";
  if (flags.includes("MODIFY")) return "write";
  if (flags.includes("ATTRIB")) return "chmod";
  return undefined;
}
