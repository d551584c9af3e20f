// Where a file or git request on a machine lands: its running agent, the path resolved as SPEC.md says (paths.ts),
// and the user it runs as. Machine files and git both start here.

import { KilnError } from "../errors.ts";
import type { AgentClient } from "../runtime/agent-client.ts";
import type { MachineService } from "./service.ts";
import { userOf } from "./exec.ts";
import { needsUserHome, resolveMachinePath } from "./paths.ts";

export interface MachineTarget {
  agent: AgentClient;
  path: string;
  user: string;
}

/** A given user must exist in the machine (400 otherwise); a relative path with no machine cwd resolves from its home. */
export async function machineTarget(machines: MachineService, id: string, path: string, user: string | undefined, o: { refuseEmpty?: boolean } = {}): Promise<MachineTarget> {
  const { row, agent } = await machines.agentOf(id);
  if (o.refuseEmpty && path === "") throw new KilnError("invalid_request", "path must not be empty");
  const info = user !== undefined ? await userOf(agent, user) : undefined;
  const home = needsUserHome(path, row.cwd, user) ? info?.home : undefined;
  let resolved: string;
  try {
    resolved = resolveMachinePath(path, { machineCwd: row.cwd, userHome: home });
  } catch (err) {
    throw new KilnError("invalid_request", (err as Error).message);
  }
  return { agent, path: resolved, user: user ?? row.user };
}
