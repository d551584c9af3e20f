// Code-interpreter contexts inside the machine: one kernel process per context (Python through python_bridge.py and
// ipykernel, JavaScript through js-kernel), run as the context's user, executes queued one at a time per context.

import { spawn } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { existsSync, readdirSync } from "node:fs";
import { basename, dirname, join } from "node:path";
import { createInterface } from "node:readline";
import type { IncomingMessage, ServerResponse } from "node:http";
import { AgentFailure } from "../errors.ts";
import { processEnv, resolveUser, workingDir } from "../process.ts";
import { killGroup } from "../process-tree.ts";
import type { CodeAdoptRequest, CodeContext, CodeContextCreate, CodeExecuteRequest, CodeFrame, CodeLanguage } from "../protocol.ts";

const LANGUAGES: readonly CodeLanguage[] = ["python", "javascript"];
const START_TIMEOUT_MS = 60_000;
/** After an interrupt, how long a kernel may take to finish the execution before it is killed as hung. */
const INTERRUPT_GRACE_MS = 3_000;
const DEFAULT_EXECUTE_TIMEOUT_MS = 300_000;

/** Where the agent's own files are: beside agent.cjs in the bundle, beside main.ts when run from source. */
const agentDir = dirname(process.argv[1] ?? import.meta.dirname);

/**
 * How to start Kiln's Node: through /opt/kiln's own loader and libraries when the agent itself runs that way — its
 * readable loader in lib/, also when the agent started from the exec-only copy (runtime/guest-runtime.ts), so a
 * kernel is an ordinary process of its user.
 */
function nodeCommand(): [string, string[]] {
  const exe = process.execPath;
  if (basename(exe).startsWith("ld-linux") || /\/exec-only\/ld\.so$/.test(exe)) {
    const root = join(dirname(exe), "..");
    const lib = join(root, "lib");
    const loader = readdirSync(lib).find((f) => f.startsWith("ld-linux"));
    if (loader) return [join(lib, loader), ["--library-path", lib, join(root, "bin", "node")]];
  }
  const lib = join(dirname(exe), "..", "lib");
  const loader = existsSync(lib) ? readdirSync(lib).find((f) => f.startsWith("ld-linux")) : undefined;
  if (loader && dirname(exe).endsWith("/opt/kiln/bin")) return [join(lib, loader), ["--library-path", lib, exe]];
  return [exe, []];
}

function kernelCommand(language: CodeLanguage, cwd: string): [string, string[]] {
  if (language === "python") return ["/usr/bin/python3", ["-u", join(agentDir, "kernels", "python_bridge.py"), cwd]];
  const bundled = join(agentDir, "kernels", "js-kernel.mjs");
  const script = existsSync(bundled) ? bundled : join(agentDir, "kernels", "js-kernel.ts");
  const [node, pre] = nodeCommand();
  return [node, [...pre, script]];
}

type BridgeFrame = CodeFrame | { type: "ready"; kernel_pid: number | null } | { type: "fatal"; error: string } | { type: "done"; execution_count: number | null; status: string };

interface Execution {
  onFrame: (f: BridgeFrame) => void;
}

/** One kernel process and the queue of executes waiting for it. */
class Kernel {
  readonly info: CodeContext;
  private child: ChildProcess | undefined;
  private current: Execution | undefined;
  private queue: Promise<unknown> = Promise.resolve();
  private exited: Promise<void> = Promise.resolve();
  private stderrTail = "";
  /** The pipes the kernel's frames and output arrive on: not read while the caller's side is full. */
  private outputs: NodeJS.ReadableStream[] = [];
  private held = false;
  dead = false;

  constructor(spec: CodeContextCreate) {
    this.info = { id: spec.id, language: spec.language, cwd: spec.cwd, user: spec.user, kernel_pid: null, created_at: new Date().toISOString() };
  }

  async start(): Promise<void> {
    const user = resolveUser(this.info.user);
    const cwd = workingDir(this.info.cwd, user);
    const [file, args] = kernelCommand(this.info.language, cwd);
    if (this.info.language === "python" && !existsSync(file)) throw new AgentFailure("invalid_request", "python3 is not installed in this machine");
    const child = spawn(file, args, {
      cwd,
      env: processEnv(user, { PYTHONUNBUFFERED: "1", PYDEVD_DISABLE_FILE_VALIDATION: "1", MPLBACKEND: "module://matplotlib_inline.backend_inline" }),
      uid: user.uid,
      gid: user.gid,
      detached: true,
      // Python: frames on its stdout. JavaScript: frames on fd 3, while fd 1/2 carry what user code writes itself.
      stdio: this.info.language === "python" ? ["pipe", "pipe", "pipe"] : ["pipe", "pipe", "pipe", "pipe"],
    });
    this.child = child;
    this.dead = false;
    this.stderrTail = "";
    this.exited = new Promise((resolve) => child.once("close", () => resolve()));
    const protocol = this.info.language === "python" ? child.stdout! : (child.stdio[3] as NodeJS.ReadableStream);
    this.outputs = this.info.language === "python" ? [protocol] : [protocol, child.stdout!, child.stderr!];
    const ready = new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => reject(new AgentFailure("timeout", "The kernel did not start within 60 s")), START_TIMEOUT_MS);
      const lines = createInterface({ input: protocol });
      lines.on("line", (line) => {
        let frame: BridgeFrame;
        try {
          frame = JSON.parse(line);
        } catch {
          return;
        }
        if (frame.type === "ready") {
          clearTimeout(timer);
          this.info.kernel_pid = frame.kernel_pid ?? null;
          resolve();
        } else if (frame.type === "fatal") {
          clearTimeout(timer);
          reject(new AgentFailure("invalid_request", `The ${this.info.language} kernel could not start: ${frame.error}`));
        } else if (this.child === child) this.current?.onFrame(frame);
      });
      child.once("error", (e: NodeJS.ErrnoException) => {
        clearTimeout(timer);
        reject(new AgentFailure("invalid_request", `Cannot start the ${this.info.language} kernel: ${e.code ?? e.message}`));
      });
      child.once("close", (code, signal) => {
        clearTimeout(timer);
        // A process replaced by a restart that took long to exit must not touch the new one's state.
        if (this.child !== child) return;
        this.dead = true;
        reject(new AgentFailure("internal", `The ${this.info.language} kernel exited at start (${signal ?? code}): ${this.stderrTail.slice(-500)}`));
        this.current?.onFrame({ type: "error", name: "KernelDied", value: `The kernel process exited (${signal ?? `code ${code}`}); restart the context`, traceback: "" });
        this.current?.onFrame({ type: "done", execution_count: null, status: "died" });
      });
    });
    child.stdin!.on("error", () => undefined);
    child.stderr!.on("data", (b: Buffer) => {
      if (this.child !== child) return;
      if (this.info.language === "javascript") this.current?.onFrame({ type: "stderr", text: b.toString("utf8") });
      else this.stderrTail = (this.stderrTail + b.toString("utf8")).slice(-4000);
    });
    if (this.info.language === "javascript") child.stdout!.on("data", (b: Buffer) => this.child === child && this.current?.onFrame({ type: "stdout", text: b.toString("utf8") }));
    try {
      await ready;
    } catch (err) {
      await this.stop();
      throw err;
    }
  }

  /**
   * The caller is not keeping up: the kernel's pipes are not read until `drained` settles, so the kernel waits on its
   * own writes instead of the agent holding its output (the agent is out of the OOM killer's way: its growth would
   * take the whole machine down). Python's own stderr tail is not held: it is kept to 4000 characters.
   */
  holdOutput(drained: Promise<unknown>) {
    if (this.held) return;
    this.held = true;
    const streams = this.outputs;
    for (const s of streams) s.pause();
    void drained.finally(() => {
      this.held = false;
      for (const s of streams) s.resume();
    });
  }

  private command(cmd: Record<string, unknown>) {
    if (this.child && !this.dead) this.child.stdin!.write(JSON.stringify(cmd) + "\n");
  }

  /**
   * Sets variables in the kernel's own os.environ for good (Python; silent: no output, no execution count). The bridge
   * runs its commands in order, so every execute sent after this one sees them.
   */
  environ(envs: Record<string, string>) {
    this.command({ op: "environ", envs });
  }

  private interrupt() {
    if (!this.child || this.dead) return;
    // The Python bridge asks its KernelManager (SIGINT to the kernel); the Node kernel takes SIGINT itself.
    if (this.info.language === "python") this.command({ op: "interrupt" });
    else this.child.kill("SIGINT");
  }

  /** Runs `code`, calling `emit` for every frame until (and including) `end`. */
  execute(code: string, timeoutMs: number, signal: AbortSignal, emit: (f: CodeFrame) => void, envs?: Record<string, string>): Promise<void> {
    const run = () =>
      new Promise<void>((resolve) => {
        const started = performance.now();
        let why: "timeout" | "interrupted" | undefined;
        let grace: NodeJS.Timeout | undefined;
        const finish = (count: number | null, status: string) => {
          clearTimeout(timer);
          clearTimeout(grace);
          signal.removeEventListener("abort", onAbort);
          this.current = undefined;
          const final = why ?? (status === "ok" ? "ok" : "error");
          emit({ type: "end", context_id: this.info.id, execution_count: count, duration_ms: Math.round((performance.now() - started) * 100) / 100, status: final });
          resolve();
        };
        const stop = (reason: "timeout" | "interrupted") => {
          if (why) return;
          why = reason;
          if (reason === "timeout") emit({ type: "error", name: "TimeoutError", value: `The execution ran past its timeout of ${timeoutMs / 1000} s and was interrupted`, traceback: "" });
          this.interrupt();
          // A kernel stuck where an interrupt cannot reach (native code, a busy event loop) is killed: restartable.
          grace = setTimeout(() => void this.kill(), INTERRUPT_GRACE_MS);
        };
        const timer = setTimeout(() => stop("timeout"), timeoutMs);
        const onAbort = () => stop("interrupted");
        signal.addEventListener("abort", onAbort);
        this.current = {
          onFrame: (f) => {
            if (f.type === "done") return finish(f.execution_count, f.status);
            if (f.type === "ready" || f.type === "fatal" || f.type === "end") return;
            emit(f);
          },
        };
        if (this.dead) {
          this.current.onFrame({ type: "error", name: "KernelDied", value: "The kernel is not running; restart the context", traceback: "" });
          return finish(null, "died");
        }
        if (signal.aborted) return finish(null, "interrupted");
        this.command({ op: "execute", code, ...(envs ? { envs } : {}) });
      });
    const next = this.queue.then(run, run);
    this.queue = next;
    return next;
  }

  private async kill() {
    if (this.child) killGroup(this.child);
    this.killKernelPid();
  }

  /** The Python kernel runs in its own session (jupyter_client starts it so); it is ended by pid as well. */
  private killKernelPid() {
    const pid = this.info.kernel_pid;
    if (pid && this.info.language === "python") {
      try {
        process.kill(pid, "SIGKILL");
      } catch {
        // already gone
      }
    }
  }

  async stop(): Promise<void> {
    if (!this.child) return;
    if (!this.dead) {
      this.command({ op: "shutdown" });
      this.child.stdin!.end();
      const quit = await Promise.race([this.exited.then(() => true), new Promise<boolean>((r) => setTimeout(() => r(false), 2_000).unref())]);
      if (!quit) killGroup(this.child);
    }
    killGroup(this.child);
    this.killKernelPid();
    await Promise.race([this.exited, new Promise((r) => setTimeout(r, 2_000).unref())]);
    this.dead = true;
  }
}

const contexts = new Map<string, Kernel>();
const defaults = new Map<CodeLanguage, string>();
/** Contexts being started, so two first executes of a language share one default context. */
const starting = new Map<string, Promise<Kernel>>();

function checkCreate(spec: Partial<CodeContextCreate> | undefined): CodeContextCreate {
  if (!spec || typeof spec.id !== "string" || !/^ctx_[a-z0-9]+$/.test(spec.id)) throw new AgentFailure("invalid_request", "id must be a ctx_ id");
  if (!LANGUAGES.includes(spec.language as CodeLanguage)) throw new AgentFailure("invalid_request", "language must be python or javascript");
  if (typeof spec.cwd !== "string" || !spec.cwd.startsWith("/")) throw new AgentFailure("invalid_request", "cwd must be an absolute path");
  if (typeof spec.user !== "string") throw new AgentFailure("invalid_request", "user is required");
  return spec as CodeContextCreate;
}

async function createContext(spec: CodeContextCreate): Promise<Kernel> {
  if (contexts.has(spec.id) || starting.has(spec.id)) throw new AgentFailure("conflict", `Context ${spec.id} exists`);
  const kernel = new Kernel(spec);
  const boot = kernel.start().then(() => kernel);
  starting.set(spec.id, boot);
  try {
    await boot;
    contexts.set(spec.id, kernel);
    return kernel;
  } finally {
    starting.delete(spec.id);
  }
}

async function defaultContext(language: CodeLanguage, spec: CodeContextCreate | undefined): Promise<Kernel> {
  const id = defaults.get(language);
  if (id) {
    const k = contexts.get(id) ?? (await starting.get(id));
    if (k) return k;
  }
  const s = checkCreate(spec);
  if (s.language !== language) throw new AgentFailure("invalid_request", "default_context.language must match language");
  defaults.set(language, s.id);
  try {
    return await createContext(s);
  } catch (err) {
    defaults.delete(language);
    throw err;
  }
}

export async function stopAllKernels(): Promise<void> {
  await Promise.all([...contexts.values()].map((k) => k.stop()));
  contexts.clear();
  defaults.clear();
}

/** Settles when `res` can take more, or will take nothing more. */
/** Per-execute environment variables: names as the shell takes them, string values, 64 KiB in all. */
function envsOf(v: unknown): Record<string, string> | undefined {
  if (v === undefined || v === null) return undefined;
  if (typeof v !== "object" || Array.isArray(v)) throw new AgentFailure("invalid_request", "envs must map names to strings");
  const entries = Object.entries(v as Record<string, unknown>);
  let bytes = 0;
  for (const [k, val] of entries) {
    if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(k) || typeof val !== "string") throw new AgentFailure("invalid_request", `envs: ${JSON.stringify(k)} must be a variable name with a string value`);
    bytes += k.length + val.length;
  }
  if (bytes > 64 * 1024) throw new AgentFailure("invalid_request", "envs are larger than 64 KiB");
  return entries.length > 0 ? (v as Record<string, string>) : undefined;
}

function drainedOrClosed(res: ServerResponse): Promise<void> {
  return new Promise((resolve) => {
    const done = () => {
      res.off("drain", done);
      res.off("close", done);
      resolve();
    };
    res.on("drain", done);
    res.on("close", done);
  });
}

type Json = (req: IncomingMessage) => Promise<Record<string, any>>;
type Send = (res: ServerResponse, status: number, body: unknown) => void;

/** The /code/* routes of the agent (see protocol.ts). Returns false when the path is not one of them. */
export async function handleCode(req: IncomingMessage, res: ServerResponse, path: string, readJson: Json, send: Send): Promise<boolean> {
  if (req.method === "GET" && path === "/code/contexts") {
    send(res, 200, { contexts: [...contexts.values()].map((k) => k.info) });
    return true;
  }
  if (req.method === "POST" && path === "/code/contexts") {
    const kernel = await createContext(checkCreate((await readJson(req)) as Partial<CodeContextCreate>));
    send(res, 200, kernel.info);
    return true;
  }
  const m = /^\/code\/contexts\/([^/]+)(\/restart)?$/.exec(path);
  if (m) {
    const id = decodeURIComponent(m[1]);
    const kernel = contexts.get(id);
    if (!kernel) throw new AgentFailure("not_found", `No code context ${id}`);
    if (req.method === "DELETE" && !m[2]) {
      contexts.delete(id);
      for (const [lang, d] of defaults) if (d === id) defaults.delete(lang);
      await kernel.stop();
      send(res, 200, { deleted: true });
      return true;
    }
    if (req.method === "POST" && m[2]) {
      await kernel.stop();
      await kernel.start();
      send(res, 200, kernel.info);
      return true;
    }
    return false;
  }
  if (req.method === "POST" && path === "/code/adopt") {
    const body = (await readJson(req)) as Partial<CodeAdoptRequest>;
    if (typeof body.user !== "string" || typeof body.cwd !== "string") throw new AgentFailure("invalid_request", "user and cwd are required");
    const envs = envsOf(body.envs) ?? {};
    const id = defaults.get("python");
    const kernel = id ? contexts.get(id) : undefined;
    if (!kernel || !id) {
      send(res, 200, { kept: false });
      return true;
    }
    // Started for the template's user and working directory: another user or cwd gets a fresh kernel on first use.
    if (kernel.dead || kernel.info.user !== body.user || kernel.info.cwd !== body.cwd) {
      contexts.delete(id);
      defaults.delete("python");
      await kernel.stop();
      send(res, 200, { kept: false });
      return true;
    }
    if (Object.keys(envs).length > 0) kernel.environ(envs);
    send(res, 200, { kept: true });
    return true;
  }
  if (req.method === "POST" && path === "/code/execute") {
    const body = (await readJson(req)) as CodeExecuteRequest;
    if (typeof body.code !== "string") throw new AgentFailure("invalid_request", "code must be a string");
    // Checked before the 200 head: a refusal after it could only cut the stream, with no answer for the caller.
    const envs = envsOf(body.envs);
    let kernel: Kernel | undefined;
    if (body.context_id !== undefined) {
      kernel = contexts.get(String(body.context_id));
      if (!kernel) throw new AgentFailure("not_found", `No code context ${body.context_id}`);
    } else {
      const language = body.language ?? "python";
      if (!LANGUAGES.includes(language)) throw new AgentFailure("invalid_request", "language must be python or javascript");
      kernel = await defaultContext(language, body.default_context);
    }
    const timeoutMs = Number.isFinite(body.timeout_ms) && body.timeout_ms! > 0 ? body.timeout_ms! : DEFAULT_EXECUTE_TIMEOUT_MS;
    const abort = new AbortController();
    res.on("close", () => {
      if (!res.writableFinished) abort.abort();
    });
    res.writeHead(200, { "content-type": "application/x-ndjson", "x-kiln-context-id": kernel.info.id });
    res.flushHeaders();
    const running = kernel;
    await kernel.execute(
      body.code,
      timeoutMs,
      abort.signal,
      (frame) => {
        if (res.writableEnded || res.destroyed) return;
        if (!res.write(JSON.stringify(frame) + "\n")) running.holdOutput(drainedOrClosed(res));
      },
      envs,
    );
    res.end();
    return true;
  }
  return false;
}
