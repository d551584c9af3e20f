// What the parts of the machine service share: the store, the driver, the per-machine lock, the records and the
// agent clients, and the teardown queue that removes destroyed machines' remains.

import type { KeyedLock } from "../keyed-lock.ts";
import type { Db } from "../store/schema.ts";
import type { MachineDriver } from "../runtime/driver.ts";
import type { Logger } from "../log.ts";
import type { MachineRecords } from "./records.ts";
import type { AgentRegistry } from "./agents.ts";
import type { Teardown } from "./teardown.ts";

export interface MachineContext {
  db: Db;
  driver: MachineDriver;
  log: Logger;
  hostId: string;
  /** Serialises lifecycle operations on one machine so hibernate/destroy/expiry never interleave. */
  locks: KeyedLock;
  records: MachineRecords;
  agents: AgentRegistry;
  /** Where a destroyed machine's host-side remains are removed, behind the request that destroyed it. */
  teardown: Teardown;
}
