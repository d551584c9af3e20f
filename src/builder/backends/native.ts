// The native backend: the steps of a build run in one build machine booted through the driver on the layers below the
// first step to run. When a step ends, every process it started is killed and the machine's writable upper dir is
// copied out as the step's read-only layer (driver.copyLayer); the next step gets a new, empty upper dir over the
// layers so far, swapped in under the running agent (driver.renewLayer) — no reboot per step. Where the driver cannot
// (runsc) or a swap fails, a step boots its own machine and its layer is taken as it stops (driver.captureLayer).
// Step output streams into the build log line by line as it happens; the layer cache lets unchanged steps skip running.

import { createReadStream } from "node:fs";
import { mkdir, rm } from "node:fs/promises";
import { basename, join, posix } from "node:path";
import type { MachineDriver } from "../../runtime/driver.ts";
import { createAgentClient } from "../../runtime/agent-client.ts";
import type { AgentClient } from "../../runtime/agent-client.ts";
import type { StreamServerFrame } from "../../agent/protocol.ts";
import { newId } from "../../store/ids.ts";
import type { Logger } from "../../log.ts";
import type { BuildBackend, BuildContext, BuildOutput, PlannedStep } from "./backend.ts";
import type { ImageConfig } from "../sources/source.ts";
import type { Instruction } from "../dockerfile.ts";
import { layerKey } from "../cache/keys.ts";
import type { LayerCache } from "../cache/layers.ts";
import { selectContext } from "../context.ts";
import type { ContextFile } from "../context.ts";
import { BuildCancelled, BuildFailure } from "../failure.ts";
import { judgeStepExit, LastLines } from "../step-exit.ts";

/** Real bounds (KILN_BUILD_STEP_TIMEOUT_S, KILN_BUILD_TIMEOUT_S, as for Dockerfile builds): a command that hangs does not hold a build machine forever. */
export const NATIVE_TIMEOUTS = { stepMs: 3_600_000, buildMs: 14_400_000 };
const TIMEOUT_ACTION = "make the step faster or split it; the limits are KILN_BUILD_STEP_TIMEOUT_S and KILN_BUILD_TIMEOUT_S";
const MAX_LINE = 4096;

/** Applies the config-changing instructions (ENV, WORKDIR, USER) of a step to the image config. */
export function applyConfig(config: ImageConfig, instructions: Instruction[]): ImageConfig {
  const next: ImageConfig = { ...config, env: { ...config.env } };
  for (const i of instructions) {
    if (i.op === "ENV") for (const [k, v] of i.envs) next.env[k] = v;
    else if (i.op === "WORKDIR") next.workingDir = posix.resolve(next.workingDir ?? "/", i.path);
    else if (i.op === "USER") next.user = i.user;
  }
  return next;
}

/**
 * How many read-only layers a machine's root may stack. overlayfs takes its lower dirs as one mount option string,
 * and the kernel caps mount options at a page (4 KiB), so long stacks of long paths do not mount. Squashing older
 * layers into one would lift this; until then a build that would pass it is refused before it starts.
 */
export const MAX_LAYERS = 40;
const MOUNT_OPTIONS_MAX = 4000;

/** Whether a machine root of `lowers` plus `added` new layers under `layersDir` fits overlayfs's option page. */
export function stackFits(lowers: string[], added: number, layersDir: string): boolean {
  if (lowers.length + added > MAX_LAYERS) return false;
  // lowerdir=…,upperdir=<machine>/upper,workdir=<machine>/work; a machine dir is about as long as layersDir + 35.
  const bytes = lowers.reduce((n, d) => n + d.length + 1, 0) + added * (layersDir.length + 31) + 2 * (layersDir.length + 45) + 40;
  return bytes <= MOUNT_OPTIONS_MAX;
}

/** Steps that only change the config (env, user) leave no filesystem change and need no machine. */
export function touchesFiles(step: PlannedStep): boolean {
  return step.instructions.some((i) => i.op === "RUN" || i.op === "COPY" || i.op === "WORKDIR");
}

/** The digests a step's result depends on besides its text: the context files a COPY reads. */
function inputDigests(step: PlannedStep, context: ContextFile[]): string[] {
  const out: string[] = [...(step.keyInputs ?? [])];
  for (const i of step.instructions) {
    if (i.op !== "COPY") continue;
    for (const { file } of selectContext(context, i.src)) out.push(`${file.path}\0${file.sha256}\0${file.mode ?? ""}`);
  }
  return out;
}

/** A failure another attempt may fix; `failure` is what to answer when no attempt is left. */
class TransientError extends Error {
  readonly failure: BuildFailure | undefined;
  constructor(message: string, failure?: BuildFailure) {
    super(message);
    this.failure = failure;
  }
}

/** How long a build machine booted ahead of time waits for a build before it is taken down. */
export const SPARE_IDLE_MS = 600_000;

export function createNativeBackend(deps: {
  driver: MachineDriver;
  layerCache: LayerCache;
  layersDir: string;
  log: Logger;
  timeouts?: { stepMs: number; buildMs: number };
  /** Boot the next build's machine ahead of time, after a build (default true; where the driver can renew a root). */
  spare?: boolean;
}): BuildBackend {
  const { driver, layerCache } = deps;
  const timeouts = deps.timeouts ?? NATIVE_TIMEOUTS;

  async function runScript(agent: AgentClient, script: string, opts: { cwd: string; user: string; envs: Record<string, string> }, onLine: (line: string, stream: "stdout" | "stderr") => void, signal: AbortSignal): Promise<number | null> {
    const ws = agent.openStream();
    return new Promise<number | null>((resolve, reject) => {
      const partial = { stdout: "", stderr: "" };
      let settled = false;
      const finish = (fn: () => void) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        signal.removeEventListener("abort", onAbort);
        ws.removeAllListeners("close");
        ws.close();
        fn();
      };
      const onAbort = () => finish(() => reject(new BuildCancelled()));
      const timer = setTimeout(
        () => finish(() => reject(new BuildFailure(`a RUN of the step ran longer than ${timeouts.stepMs / 1000} s and was stopped`, { phase: "step", suggestedAction: TIMEOUT_ACTION }))),
        timeouts.stepMs,
      );
      signal.addEventListener("abort", onAbort);
      const feed = (stream: "stdout" | "stderr", text: string) => {
        const lines = (partial[stream] + text).split("\n");
        partial[stream] = lines.pop() ?? "";
        if (partial[stream].length > MAX_LINE) {
          lines.push(partial[stream]);
          partial[stream] = "";
        }
        for (const l of lines) onLine(l.replace(/\r$/, "").slice(0, MAX_LINE), stream);
      };
      ws.on("open", () => ws.send(JSON.stringify({ type: "exec.start", request_id: "step", cmd: "/bin/sh", args: ["-c", script], cwd: opts.cwd, envs: opts.envs, user: opts.user })));
      ws.on("message", (data) => {
        const f = JSON.parse(String(data)) as StreamServerFrame;
        if (f.type === "exec.stdout" || f.type === "exec.stderr") feed(f.type === "exec.stdout" ? "stdout" : "stderr", Buffer.from(f.data_base64, "base64").toString("utf8"));
        else if (f.type === "exec.exit") {
          for (const s of ["stdout", "stderr"] as const) if (partial[s]) onLine(partial[s].slice(0, MAX_LINE), s);
          finish(() => resolve(f.exit_code ?? (f.signal ? 128 : 1)));
        } else if (f.type === "error") finish(() => reject(new BuildFailure(`the step could not start: ${f.error}`, { phase: "step" })));
      });
      ws.on("error", (err) => finish(() => reject(new TransientError(`the build machine's agent went away: ${err.message}`))));
      ws.on("close", () => finish(() => reject(new TransientError("the build machine's agent closed the stream before the step ended"))));
    });
  }

  async function copyIn(agent: AgentClient, i: Extract<Instruction, { op: "COPY" }>, config: ImageConfig, context: ContextFile[], stepIndex: number) {
    const picked = selectContext(context, i.src);
    if (picked.length === 0) throw new BuildFailure(`copy: ${JSON.stringify(i.src)} is not in the build context`, { phase: "step", stepIndex, suggestedAction: "add the file to context.files" });
    const dest = posix.resolve(config.workingDir ?? "/", i.dest);
    const intoDir = i.dest.endsWith("/") || picked.length > 1 || picked[0].rel !== "";
    for (const { file, rel } of picked) {
      const target = intoDir ? posix.join(dest, rel || basename(file.path)) : dest;
      await agent.writeFile(target, createReadStream(file.blobPath), { mode: i.mode ?? file.mode ?? "0644", user: i.owner });
    }
  }

  /** The build machine the steps run in: its agent, and the layers its root stands on now (with a step's upper dir over them). */
  interface BuildMachine {
    id: string;
    agent: AgentClient;
    /** Steps run in it so far (the first boots it; each later one renews its root). */
    steps: number;
  }

  /**
   * A finished build's machines, being destroyed behind its answer: its layers are taken, nothing of the machine is
   * needed any more. A crash meanwhile leaves a machine no record keeps, which the next start removes (machines/adoption.ts).
   */
  const teardowns = new Set<Promise<void>>();

  /**
   * One build machine booted ahead of time for the next build, after a declarative build (on Kiln's base template:
   * never on layers a user supplied, whose files its agent might read as it starts). Taken by one build only, whose
   * first step swaps its root for that build's layers (driver.renewLayer); it has run nothing before. Keyed by the
   * machine's size and network: a build that asks for another boots its own.
   */
  let spare: { key: string; ready: Promise<BuildMachine | undefined>; timer: NodeJS.Timeout } | undefined;
  let closed = false;
  const vmKey = (vm: BuildContext["vm"]) => `${vm.vcpus}/${vm.memoryMb}/${vm.internet}`;

  function bootSpare(ctx: BuildContext): void {
    const layer = ctx.source.type === "declarative" ? ctx.source.layers[0]?.dir : undefined;
    if (closed || spare || deps.spare === false || !driver.renewLayer || !driver.copyLayer || !layer || ctx.source.layers.length !== 1) return;
    const id = newId("mch");
    const ready = driver.create({ id, layers: [layer], hostname: "kiln-build", vcpus: ctx.vm.vcpus, memoryMb: ctx.vm.memoryMb, internet: ctx.vm.internet, mounts: [] }).then(
      (live): BuildMachine => ({ id, agent: createAgentClient(live.agentSocket), steps: 0 }),
      async (err: unknown) => {
        deps.log.warn({ err, machine_id: id }, "a build machine booted ahead of time did not start");
        await driver.destroy(id).catch(() => undefined);
        return undefined;
      },
    );
    const timer = setTimeout(() => void dropSpare(), SPARE_IDLE_MS);
    timer.unref();
    spare = { key: vmKey(ctx.vm), ready, timer };
  }

  /** The spare for a build of `vm`, if there is one (no longer the spare: the caller owns it). */
  function takeSpare(vm: BuildContext["vm"]): Promise<BuildMachine | undefined> | undefined {
    if (!spare || spare.key !== vmKey(vm)) return undefined;
    const taken = spare;
    spare = undefined;
    clearTimeout(taken.timer);
    return taken.ready;
  }

  async function dropSpare(): Promise<void> {
    const s = spare;
    spare = undefined;
    if (!s) return;
    clearTimeout(s.timer);
    await dismiss(await s.ready);
  }

  /** Takes a build machine down (its agent's connections closed first); a failure is logged, never thrown. */
  async function dismiss(m: BuildMachine | undefined): Promise<void> {
    if (!m) return;
    await m.agent.close().catch(() => undefined);
    await driver.destroy(m.id).catch((err: unknown) => deps.log.error({ err, machine_id: m.id }, "destroying a build machine failed"));
  }

  /**
   * Runs one step and captures its layer into `layerDir`: in `machine` when there is one (its root renewed over
   * `lowers`), else in a build machine booted on `lowers`. Resolves to the machine for the next step (undefined when
   * this driver boots one per step); on failure the machine is destroyed.
   */
  async function runStep(ctx: BuildContext, step: PlannedStep, lowers: string[], configBefore: ImageConfig, layerDir: string, attempt: number, machine: BuildMachine | undefined): Promise<BuildMachine | undefined> {
    const common = { step_index: step.index, total_steps: ctx.steps.length, attempt, max_attempts: ctx.maxAttempts };
    const keep = driver.copyLayer !== undefined && driver.renewLayer !== undefined;
    let m = machine;
    try {
      if (m) {
        const t0 = performance.now();
        try {
          await driver.renewLayer!(m.id, lowers);
          m.steps++;
          ctx.log({ kind: "message", phase: "vm_create", message: `step ${step.index}/${ctx.steps.length} runs in the build machine of the steps before it, on a new writable layer (${Math.round(performance.now() - t0)} ms)`, ...common, level: "debug" });
        } catch (err) {
          // The machine is left as the swap found it: a new one takes the step instead.
          deps.log.warn({ err, machine_id: m.id }, "a build machine's root could not be renewed; booting another");
          const old = m;
          m = undefined;
          await dismiss(old);
        }
      }
      const ahead = m ? undefined : takeSpare(ctx.vm);
      if (ahead) {
        const t0 = performance.now();
        // One that did not start was taken down already (and said so): a machine is booted below instead.
        const got = await ahead;
        if (got) {
          try {
            await driver.renewLayer!(got.id, lowers);
            got.steps = 1;
            m = got;
            ctx.log({ kind: "message", phase: "vm_create", message: `step ${step.index}/${ctx.steps.length} runs in a build machine booted ahead of time, on the layers so far (${Math.round(performance.now() - t0)} ms)`, ...common, level: "debug" });
          } catch (err) {
            deps.log.warn({ err, machine_id: got.id }, "a build machine booted ahead of time could not be used; booting another");
            await dismiss(got);
          }
        }
      }
      if (!m) {
        const id = newId("mch");
        const t0 = performance.now();
        ctx.log({ kind: "message", phase: "vm_create", message: `starting a build machine for step ${step.index}/${ctx.steps.length}`, ...common, level: "debug" });
        const live = await driver.create({ id, layers: lowers, hostname: "kiln-build", vcpus: ctx.vm.vcpus, memoryMb: ctx.vm.memoryMb, internet: ctx.vm.internet, mounts: [] }).catch(async (err: unknown) => {
          await driver.destroy(id).catch(() => undefined);
          throw new TransientError(`the build machine did not start: ${(err as Error).message}`);
        });
        m = { id, agent: createAgentClient(live.agentSocket), steps: 1 };
        ctx.log({ kind: "message", phase: "vm_create", message: `build machine for step ${step.index}/${ctx.steps.length} started (${Math.round(performance.now() - t0)} ms)`, ...common, level: "debug" });
      }
      const agent = m.agent;
      const started = performance.now();
      let config = configBefore;
      ctx.log({ kind: "message", phase: "step", message: `step ${step.index}/${ctx.steps.length}: ${step.description}`, ...common });
      for (const ins of step.instructions) {
        if (ctx.signal.aborted) throw new BuildCancelled();
        if (ins.op === "RUN") {
          const last = new LastLines();
          const code = await runScript(
            agent,
            ins.script,
            { cwd: config.workingDir ?? "/", user: config.user ?? "root", envs: { ...Object.fromEntries(ins.envs ?? []), ...config.env, ...ctx.buildEnvs } },
            (line) => {
              last.push(line);
              ctx.log({ kind: "message", phase: "step", message: line, ...common });
            },
            ctx.signal,
          );
          if (code !== 0) {
            // Only a fetch that the network let down is tried again; the step's own failure would fail the same way.
            const lines = last.get();
            const judged = judgeStepExit(step.transient, lines);
            const tail = lines.at(-1);
            const msg = `step ${step.index}/${ctx.steps.length} (${step.description}) exited with code ${code}${tail ? `: ${tail}` : ""}`;
            const failure = new BuildFailure(msg, { phase: "step", stepIndex: step.index, retryable: judged.retryable, suggestedAction: judged.suggestedAction, details: { exit_code: code, last_lines: lines } });
            if (judged.retryable) throw new TransientError(msg, failure);
            throw failure;
          }
        } else if (ins.op === "COPY") {
          await copyIn(agent, ins, config, ctx.context, step.index);
        } else if (ins.op === "WORKDIR") {
          const path = posix.resolve(config.workingDir ?? "/", ins.path);
          await agent.mkdir(path, { user: config.user && config.user !== "root" ? config.user : undefined });
        }
        config = applyConfig(config, [ins]);
      }
      const ran = performance.now();
      ctx.log({ kind: "message", phase: "snapshot", message: `capturing the layer of step ${step.index}`, ...common, level: "debug" });
      if (keep) {
        // Every process the step started is gone before its layer is copied; the machine goes on for the next step.
        await driver.copyLayer!(m.id, layerDir).catch((err: unknown) => {
          throw new TransientError(`the layer of step ${step.index} could not be taken: ${(err as Error).message}`);
        });
      } else {
        await m.agent.close();
        const id = m.id;
        m = undefined;
        await driver.captureLayer(id, layerDir).catch(async (err: unknown) => {
          await driver.destroy(id).catch((e: unknown) => deps.log.error({ err: e, machine_id: id }, "destroying a build machine failed"));
          throw err;
        });
      }
      ctx.log({ kind: "message", phase: "snapshot", message: `step ${step.index}/${ctx.steps.length} ran in ${Math.round(ran - started)} ms, its layer taken in ${Math.round(performance.now() - ran)} ms`, ...common, level: "debug" });
      return m;
    } catch (err) {
      await dismiss(m);
      throw err;
    }
  }

  /** The steps under the build's own deadline: at it, the step running is stopped (its machine destroyed) and the build fails. */
  async function run(ctx: BuildContext): Promise<BuildOutput> {
    const expiry = new AbortController();
    const timer = setTimeout(() => expiry.abort(), timeouts.buildMs);
    try {
      return await runSteps({ ...ctx, signal: AbortSignal.any([ctx.signal, expiry.signal]) });
    } catch (err) {
      if (expiry.signal.aborted && !ctx.signal.aborted) throw new BuildFailure(`the build ran longer than ${timeouts.buildMs / 1000} s and was stopped`, { phase: "step", suggestedAction: TIMEOUT_ACTION });
      throw err;
    } finally {
      clearTimeout(timer);
    }
  }

  async function runSteps(ctx: BuildContext): Promise<BuildOutput> {
    let parentKey = ctx.source.digest;
    let config: ImageConfig = { ...ctx.source.config, env: { ...ctx.source.config.env } };
    const lowers = ctx.source.layers.map((l) => l.dir);
    const layers: BuildOutput["layers"] = [];
    await mkdir(deps.layersDir, { recursive: true });
    let machine: BuildMachine | undefined;
    try {
      for (const step of ctx.steps) {
        if (ctx.signal.aborted) throw new BuildCancelled();
        const key = layerKey(parentKey, step.text, inputDigests(step, ctx.context));
        const common = { step_index: step.index, total_steps: ctx.steps.length };
        const target = `step ${step.index}: ${step.description}`;
        let cached: { dir: string | null } | null = null;
        if (ctx.skipCache) {
          ctx.count("layer_bypasses");
          ctx.log({ kind: "cache", phase: "cache", cache_layer: "layer", cache_outcome: "bypass", cache_reason: "whole_build_skip_cache", cache_target: target, message: `cache bypass: ${target}`, ...common });
        } else {
          cached = await layerCache.lookup(key);
          ctx.count(cached ? "layer_hits" : "layer_misses");
          ctx.log(
            cached
              ? { kind: "cache", phase: "cache", cache_layer: "layer", cache_outcome: "hit", cache_target: target, message: `cache hit: ${target}`, ...common }
              : { kind: "cache", phase: "cache", cache_layer: "layer", cache_outcome: "miss", cache_reason: "missing_or_incompatible", cache_target: target, message: `cache miss: ${target}`, ...common },
          );
        }
        const configBefore = config;
        config = applyConfig(config, step.instructions);
        if (cached) {
          if (cached.dir) {
            lowers.push(cached.dir);
            layers.push({ dir: cached.dir, digest: key });
          }
          parentKey = key;
          continue;
        }
        let dir: string | null = null;
        if (touchesFiles(step)) {
          // Short names keep the lower-dir mount option small: 20 hex of the key and the id's 8 random characters.
          dir = join(deps.layersDir, `${key.slice("sha256:".length, "sha256:".length + 20)}-${newId("bld").slice(-8)}`);
          for (let attempt = 1; ; attempt++) {
            try {
              machine = await runStep(ctx, step, lowers, configBefore, dir, attempt, machine);
              break;
            } catch (err) {
              machine = undefined; // runStep destroyed it
              await rm(dir, { recursive: true, force: true }).catch(() => undefined);
              if (!(err instanceof TransientError)) {
                if (err instanceof BuildFailure && err.stepIndex === undefined) throw new BuildFailure(err.message, { phase: err.phase, stepIndex: step.index, retryable: err.retryable, suggestedAction: err.suggestedAction });
                throw err;
              }
              if (ctx.signal.aborted) throw new BuildCancelled();
              if (attempt >= ctx.maxAttempts) {
                const f = err.failure;
                throw new BuildFailure(`${err.message} (after ${attempt} attempts)`, { phase: "step", stepIndex: step.index, retryable: true, suggestedAction: f?.suggestedAction, details: f?.details });
              }
              ctx.log({ kind: "retry", level: "warn", phase: "retry", message: `${err.message}; trying step ${step.index} again`, ...common, attempt: attempt + 1, max_attempts: ctx.maxAttempts });
            }
          }
          lowers.push(dir);
          layers.push({ dir, digest: key });
        }
        await layerCache.store(key, dir);
        ctx.count("layer_stores");
        ctx.log({ kind: "cache", phase: "cache", cache_layer: "layer", cache_outcome: "stored", cache_target: target, message: `cached: ${target}`, ...common, level: "debug" });
        parentKey = key;
      }
      if (machine) {
        const going: Promise<void> = dismiss(machine).finally(() => teardowns.delete(going));
        teardowns.add(going);
        machine = undefined;
      }
    } finally {
      // A failed or cancelled build answers only once its machine is gone.
      await dismiss(machine);
      // Not after a cancel (or the build's deadline): its answer says nothing of the build runs any more.
      if (!ctx.signal.aborted) bootSpare(ctx);
    }
    return { layers, config };
  }

  /** Resolves once no build machine of a finished build is still being destroyed, and the spare's boot has settled. */
  async function settle(): Promise<void> {
    while (teardowns.size > 0) await Promise.all([...teardowns]);
    await spare?.ready;
  }

  /** Takes down the machine booted ahead of time and waits for every teardown; no spare is booted after. */
  async function close(): Promise<void> {
    closed = true;
    await dropSpare();
    await settle();
  }

  return { name: "native", run, settle, close };
}
