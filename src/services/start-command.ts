// A template's start command at machine create (runc cannot checkpoint a running process on this host, so machines
// start it themselves): launched in its own session with only the template's envs, then held to its readiness check.

import type { AgentClient } from "../runtime/agent-client.ts";
import type { ArtifactConfig } from "../builder/artifact-config.ts";
import { shellQuote } from "../builder/dockerfile.ts";
import { KilnError } from "../errors.ts";

/** A real bound on readiness: a start command that never gets ready fails the create instead of hanging it. */
export const READY_TIMEOUT_MS = 60_000;
/** Without ready_cmd, the start command is up once it has stayed alive this long. */
const ALIVE_FOR_MS = 1_000;
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
