// The bundle's entry (agent.cjs). It turns on Node's compile cache before the agent's own code loads, so that code is
// read from V8 code cached when the guest runtime was built (bundle.ts) instead of compiled again in every machine.
// The cache sits beside the bundle on the read-only /opt/kiln: a machine can neither write nor replace it. Node
// checks each entry against its module's source and a checksum of its own, and V8 against its version and flags; an
// entry that fails any check is compiled afresh (and nothing is written back: the mount is read-only).

import { enableCompileCache } from "node:module";
import { join } from "node:path";
import { AGENT_COMPILE_CACHE_DIR, AGENT_MAIN_FILE } from "./protocol.ts";

// Portable: the cache's entries name modules relative to it, so a cache made in the build directory matches here.
enableCompileCache({ directory: join(__dirname, AGENT_COMPILE_CACHE_DIR), portable: true });
require(join(__dirname, AGENT_MAIN_FILE));
