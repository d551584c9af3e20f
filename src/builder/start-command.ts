// A template's start command: launched in its own session with only the template's envs and held to its readiness
// check once during the build. Under gVisor the ready build machine is checkpointed and machines continue it; under
// runc (CRIU cannot checkpoint on this host) every machine create starts it again and waits for readiness.

import type { AgentClient } from "../runtime/agent-client.ts";
import { createAgentClient } from "../runtime/agent-client.ts";
import type { MachineCheckpoint, MachineDriver } from "../runtime/driver.ts";
import { newId } from "../store/ids.ts";
import type { ArtifactConfig } from "./artifact-config.ts";
import { shellQuote } from "./dockerfile.ts";
import { KilnError } from "../errors.ts";
import { BuildFailure } from "./failure.ts";
import type { LogInput } from "./log.ts";

/** A real bound on readiness: a start command that never gets ready fails the create instead of hanging it. */
export const READY_TIMEOUT_MS = 60_000;
/** Without ready_cmd, the start command is up once it has stayed alive this long. */
export const ALIVE_FOR_MS = 1_000;
export const START_LOG = "/tmp/kiln-start.log";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

export async function runStartCommand(agent: AgentClient, config: ArtifactConfig, user: string): Promise<void> {
  if (!config.startCmd) return;
  const cwd = config.image.workingDir ?? "/";
  const launched = await agent.exec({
    cmd: `setsid /bin/sh -c ${shellQuote(config.startCmd)} >${START_LOG} 2>&1 </dev/null & echo $!`,
    cwd,
    user,
    envs: config.image.env,
  });
  const pid = Number(Buffer.from(launched.stdout_base64, "base64").toString().trim());
  if (launched.exit_code !== 0 || !Number.isInteger(pid)) throw new KilnError("unavailable", "The template's start_cmd could not be started");
  const deadline = Date.now() + READY_TIMEOUT_MS;
  if (!config.readyCmd) {
    await sleep(ALIVE_FOR_MS);
    const alive = await agent.exec({ cmd: `kill -0 ${pid}`, user: "root" });
    if (alive.exit_code !== 0) throw new KilnError("unavailable", `The template's start_cmd exited within ${ALIVE_FOR_MS} ms (its output is in ${START_LOG})`);
    return;
  }
  for (;;) {
    const r = await agent.exec({ cmd: config.readyCmd, cwd, user, envs: config.image.env, timeout_ms: 10_000 });
    if (r.exit_code === 0) return;
    if (Date.now() > deadline) throw new KilnError("unavailable", `The template's ready_cmd did not succeed within ${READY_TIMEOUT_MS / 1000} s`);
    await sleep(100);
  }
}

/**
 * Boots a machine on the artifact's layers, starts start_cmd and waits for readiness, then checkpoints it into
 * `checkpointDir` where the driver can (a failed checkpoint only means machines start it at create), and removes it.
 */
export async function verifyStartCommand(opts: {
  driver: MachineDriver;
  layers: string[];
  config: ArtifactConfig;
  vm: { vcpus: number; memoryMb: number; internet: boolean };
  log: (e: LogInput) => void;
  checkpointDir: string;
}): Promise<MachineCheckpoint | undefined> {
  const id = newId("mch");
  const user = opts.config.image.user ?? "user";
  opts.log({ kind: "message", phase: "startup", message: `starting start_cmd as ${user} in a machine made from the new layers` });
  let agent: AgentClient | undefined;
  try {
    const live = await opts.driver.create({ id, layers: opts.layers, hostname: "kiln-build", vcpus: opts.vm.vcpus, memoryMb: opts.vm.memoryMb, internet: opts.vm.internet, mounts: [] });
    agent = createAgentClient(live.agentSocket);
    if (Object.keys(opts.config.image.env).length > 0) await agent.setEnvs(opts.config.image.env);
    opts.log({ kind: "message", phase: "readiness", message: opts.config.readyCmd ? "waiting for ready_cmd to succeed" : `waiting for start_cmd to stay alive for ${ALIVE_FOR_MS} ms` });
    await runStartCommand(agent, opts.config, user);
  } catch (err) {
    await agent?.close().catch(() => undefined);
    await opts.driver.destroy(id).catch(() => undefined);
    const message = err instanceof KilnError ? err.message : `the start command could not be tried: ${(err as Error).message}`;
    throw new BuildFailure(message, { phase: "readiness", suggestedAction: "fix start_cmd or ready_cmd and build again" });
  }
  try {
    await agent.close().catch(() => undefined);
    if (!opts.driver.checkpoint) {
      opts.log({ kind: "message", phase: "snapshot", message: "start_cmd got ready; no checkpoint is taken (CRIU cannot checkpoint on this host): machines will start it at create and wait for its readiness" });
      return undefined;
    }
    const saved = await opts.driver.checkpoint(id, opts.checkpointDir);
    opts.log({ kind: "message", phase: "snapshot", message: "start_cmd got ready and was checkpointed under gVisor: machines made from this template continue it instead of starting it again" });
    return saved;
  } catch (err) {
    opts.log({ kind: "message", phase: "snapshot", level: "warn", message: `start_cmd got ready but the checkpoint failed (${(err as Error).message.slice(0, 300)}): machines will start it at create and wait for its readiness` });
    return undefined;
  } finally {
    await opts.driver.destroy(id).catch(() => undefined);
  }
}
