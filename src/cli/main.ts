// The `kiln` command (bin/kiln): the command tree is in program.ts.

import { usePrivateUmask } from "../data-dir.ts";
import { kilnProgram } from "./program.ts";

// Whatever a command writes (the store and its WAL from `kiln keys`, a base template's cache) is private, as the
// server's files are.
usePrivateUmask();

// A reader that has what it wanted and goes away (`kiln webhooks create … | head -1`) ends the command quietly, as
// for any Unix tool, instead of an unhandled EPIPE.
process.stdout.on("error", (err: NodeJS.ErrnoException) => {
  if (err.code === "EPIPE") process.exit(0);
  throw err;
});

await kilnProgram().parseAsync(process.argv);
